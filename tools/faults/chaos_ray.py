"""Ray trials: a worker node of a 3-node Ray cluster lost mid-run, then back
(tools/cluster/ray_cluster.py's nodes on tools/cluster/netcluster.py's hosts; root).

    python tools/faults/chaos_ray.py                       # MWMS, 5 trials (make chaos-ray)
    python tools/faults/chaos_ray.py --strategy=horovod --trials=5

Each trial starts a Ray head on host 0 and a 1-CPU node on hosts 1 and 2, then runs
`tfdist launch --engine=ray --workers=2 --min_workers=1 --max_workers=2` on host 0: one Ray Train
worker on each node, gpt_nano for STEPS (1000) steps (global batch 16, a backup every 5). Once
the run has logged a step chosen at random (seeded, 8-30), node 2's `ray start`, its raylet and its
workers are SIGKILLed and its link is cut. Ray finds the node gone and restarts the group on the
node left (min 1). Once the job trains on 1 worker and has logged GROW_AT, the link is healed and
node 2 started again; Ray (every --discovery_interval seconds) sees the CPU back and resizes the
group to 2. Before it does, the 1-worker group backs up the step it is at
(tfdist/launch/ray_resize.py), and the 2-worker group resumes there.

A trial passes when the launcher exits 0; the job trained on 1 worker within CONTINUE_BOUND of the
kill; it trained on 2 again within JOIN_BOUND of the node's return; every step 1..STEPS is in
metrics.json once, each with the same global batch; and every step's loss equals an
uninterrupted 2-worker run's (on this machine's loopback) within 1e-5; and the grow lost no step:
the group stopped for it at one step ("preempted (Ray's resize) at step N") and the group of 2
resumed at that step. Also recorded, for each restart: the steps metrics.json had logged after
the backup it resumed from. That is a lower bound of the steps run again: metrics.json is
written at each backup, so the up to `every_steps - 1` steps run after the newest one are not in
it (a killed node's steps since its newest backup run again).

Prints a table and writes bench_results/chaos-ray-<strategy>.json. Exit status 1 if a trial
fails.
"""
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.cluster.netcluster import NetCluster  # noqa: E402
from tools.cluster.ray_cluster import RayCluster  # noqa: E402
from tools.faults.chaos_elastic import Follow, arguments, rows, train_flags, trials  # noqa: E402

STEPS = 1000  # (a resize takes Ray longer than tfdist's own path: a run long enough to see it)
GROW_AT = 50
RESIZE_INTERVAL = 5  # seconds: Ray's elastic_resize_monitor_interval_s (--discovery_interval)


def ray_trial(net, nodes, work, data_dir, strategy, at_step, grow=True, steps=STEPS, timeout=900):
    """An elastic `tfdist launch --engine=ray` from host 0 on the Ray `nodes`; node 2 killed and
    cut off once `at_step` is logged, started again (if `grow`) once GROW_AT is. Returns what
    happened (every wait is bounded; the launcher is killed at `timeout`)."""
    p = net.popen(0, [sys.executable, "-m", "tfdist", "launch", "--engine=ray",
                      f"--address={nodes.address}", f"--strategy={strategy}", "--workers=2",
                      "--min_workers=1", "--max_workers=2",
                      f"--discovery_interval={RESIZE_INTERVAL}", "--max_restarts=3",
                      f"--storage={work}-ray", "--", *train_flags(work, data_dir, steps)],
                  cwd=ROOT, env={**nodes.env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT, text=True)
    run = Follow(p, work, timeout)
    r = {"cut_at": None, "continued_s": None, "offered_at": None, "joined_at": None,
         "joined_s": None, "before_join": None}
    last, wait = run.last, run.wait
    if wait(lambda: last()["step"] >= at_step):
        r["cut_at"] = last()["step"]
        killed = time.time()
        nodes.stop(2, hard=True)  # its `ray start`, raylet and workers: SIGKILL, by PID
        net.partition(2)
        if wait(lambda: any(x["replicas"] == 1 for x in rows(work))):
            r["continued_s"] = run.started_alone(killed)
            if grow and wait(lambda: last()["step"] >= GROW_AT):
                r["offered_at"] = last()["step"]
                net.heal(2)
                nodes.start(2)
                offered = time.time()
                seen = [0]  # the newest step the 1-worker group logged

                def joined():
                    x = last()
                    if x["replicas"] == 1:
                        seen[0] = max(seen[0], x["step"])
                    return x["replicas"] == 2
                if wait(joined):
                    r["before_join"] = seen[0]
                    joined = next(x for x in rows(work)
                                  if x["step"] > r["offered_at"] and x["replicas"] == 2)
                    r["joined_at"] = joined["step"]
                    r["joined_s"] = round(joined["time"] - joined["step_time"] - offered, 1)
    r.update(run.end())
    r["resumed_at"] = sorted(set(r["resumed_at"]))  # (one line from each worker)
    r["stopped_for_grow"] = sorted({int(s) for s in re.findall(
        r"preempted \(Ray's resize\) at step (\d+)", r["output"])})
    return r


def grow_lossless(r):
    """The group stopped for the grow (once, or again after a grow Ray retried) and each time a
    group resumed at that step, the last one the group of 2."""
    stopped = r["stopped_for_grow"]
    return {"grow lossless": bool(stopped) and set(stopped) <= set(r["resumed_at"])
            and r["resumed_at"][-1] == stopped[-1]}


def logged_after_backup(r):
    """For each restart, the steps logged after the backup it resumed from (the kill's: cut_at -
    resumed; the grow's: the 1-worker group's newest logged step - resumed); see the module doc."""
    resumed = r["resumed_at"]
    lost = []
    if r["cut_at"] is not None and resumed:
        lost.append(max(0, r["cut_at"] - resumed[0]))
    if r["before_join"] is not None and len(resumed) > 1:
        lost.append(max(0, r["before_join"] - resumed[-1]))
    return lost


def main():
    args = arguments(__doc__, "chaos-ray")

    def trial(work, data_dir, strategy, at):
        with NetCluster(3, rate="1gbit") as net, RayCluster(net) as nodes:
            return ray_trial(net, nodes, work, data_dir, strategy, at)
    return trials(args, trial, STEPS, extra=lambda r: {
        "logged_after_backup": logged_after_backup(r), "stopped_for_grow": r["stopped_for_grow"]},
        more_checks=grow_lossless, engine="ray", resize_interval_s=RESIZE_INTERVAL)


if __name__ == "__main__":
    sys.exit(main())
