"""Hosts lost under `tfdist launch --spares`, across tools/cluster/netcluster.py's hosts (root):
the trial that `make bench-node-loss` times, and three chaos faults, 5 trials each.

    python tools/faults/chaos_spares.py --fault=spare_lost           # make chaos-spares runs all
    python tools/faults/chaos_spares.py --fault=owner_and_peer
    python tools/faults/chaos_spares.py --fault=during_transfer

Every trial runs the fault driver (tools/faults/faulty_train.py: gpt_nano, STEPS steps of a
global batch of 16, a backup every 5) as 2 workers of `tfdist launch --hosts=... --spares=K`,
started on host 0, and kills hosts at seeded steps: every process of a host SIGKILLed and its link
cut for good (`NetCluster.kill`, `partition`), as a host that dies.

* **spare_lost** (MWMS; workers on hosts 0 and 1, spares on 2 and 3): host 2, the first spare, is
  killed while it waits; later host 1 is killed, and host 3, the second spare, takes its place
  with the state of host 0's memory. The launcher says the first spare is lost, and does not
  restart the group for it.
* **owner_and_peer** (ZeRO-3 over 2 Horovod ranks on hosts 1 and 2, spares on 3 and 4, the
  launcher alone on host 0): hosts 1 and 2 are killed together, each rank's shard with the peer
  copy of the other's. No keeper holds a complete step: the group resumes on the spares from the
  newest disk backup (every 5 steps; the one before it when its write was in flight), exactly.
* **during_transfer** (MWMS; workers on 0 and 1, spares on 2 and 3; host 2's link at 2 Mbit/s):
  host 1 is killed; host 2 takes its place, and is killed while host 0's keeper sends it the
  state (a connection from the keeper's port, the plan's, with bytes queued for host 2, seen with
  `ss`); host 3 takes its place, with the state of host 0's memory.

A trial passes when the launcher exits 0, every step 1..STEPS is logged once in metrics.json with
the same global batch, the losses equal an uninterrupted run's (this machine's loopback, the
same strategy and ZeRO stage) within 1e-5, both workers end with bitwise equal weights, and the
steps trained twice (worker 0's executed steps beyond STEPS) are those the fault allows (none
with the state from memory). Prints a table and writes bench_results/chaos-spares-<fault>.json.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.cluster.netcluster import NetCluster  # noqa: E402
from tools.faults.chaos_elastic import Follow  # noqa: E402
from tools.faults.chaos_partition import prepare_data, report, yes  # noqa: E402
from tools.faults.harness import (  # noqa: E402
    DRIVER,
    losses,
    max_diff,
    metrics,
    steps_by_worker,
    weights,
)

STEPS = 120
EVERY = 5
BATCH = 16
TOLERANCE = 1e-5


def overrides(data_dir, strategy, zero=0, memory=True):
    return {"data.data_dir": data_dir, "strategy.name": strategy, "train.steps": STEPS,
            "train.steps_per_epoch": 40, "train.batch_size": BATCH, "train.eval_steps": 2,
            "backup.every_steps": EVERY, "zero.stage": zero,
            **({} if memory else {"backup.memory_every_steps": 0})}


def steps_done(work):
    """The steps worker 0 has run (its executed_steps.txt: every step, as it runs)."""
    return steps_by_worker(work).get(0, 0)


def launch(net, work, o, workers, spares, launcher=0, extra=(), elastic=False, timeout=900):
    """`tfdist launch` of the driver on host `launcher`: 2 workers on hosts `workers`, the hosts
    `spares` kept as spares (or, `elastic`, a group of 1 to 2 on `workers` that shrinks after
    10 s without the lost host). A `Follow` of it."""
    env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1"}
    hosts = ",".join(net.address(i) for i in (*workers, *spares))
    if elastic:
        hosts_file = f"{work}-hosts.txt"
        with open(hosts_file, "w") as f:
            f.write("".join(f"{net.address(i)}:1\n" for i in workers))
        how = ["--min_workers=1", "--max_workers=2", f"--discovery=cat {hosts_file}",
               "--rejoin_timeout=10", "--discovery_interval=1"]
    else:
        how = [f"--hosts={hosts}", f"--spares={len(spares)}"]
    p = net.popen(launcher, [sys.executable, "-m", "tfdist", "launch",
                             f"--strategy={o['strategy.name']}", "--workers=2", *how,
                             "--max_restarts=3", "--backoff=1", *extra, "--", sys.executable,
                             DRIVER, str(work), json.dumps(o), "--dump-weights"],
                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return Follow(p, work, timeout)


def lose(net, hosts):
    """Every process of `hosts` SIGKILLed and their links cut: hosts that died (together: every
    link is cut before the first process dies)."""
    for i in hosts:
        net.partition(i)
    for i in hosts:
        net.kill(i)
    return time.time()


def first_step_after(work, when):
    """Seconds from `when` (time.time()) to the start of the first step logged after it."""
    try:
        rows = metrics(work)["steps"]
    except (OSError, ValueError, KeyError):
        return None
    after = [r for r in rows if r["time"] - r["step_time"] > when]
    return round(after[0]["time"] - after[0]["step_time"] - when, 2) if after else None


def outcome(run, work, killed):
    """What a trial left: its exit, output, how it resumed, the time to the first step after
    the (last) kill, and the steps worker 0 ran twice."""
    end = run.end()
    out = end["output"]
    found = re.findall(r"resuming from (\S+) at step (\d+) of", out)
    return {"exit": end["exit"], "output": out,
            "resumed": [("memory" if s.startswith("memory:") else "disk", int(n))
                        for s, n in found],
            "resume_s": first_step_after(work, killed) if killed else None,
            "twice": max(0, steps_done(work) - STEPS) if steps_done(work) else None}


def verdict(r, work, reference, twice_allowed=0, replicas=2):
    """The checks of a trial (module doc), by name; and the largest loss difference. With one
    replica at the end (a shrunk group), there is no other to compare its weights with."""
    try:
        rows = metrics(work)["steps"]
    except (OSError, ValueError, KeyError):
        rows = []
    got = [x["loss"] for x in rows]
    diff = (max(abs(a - b) for a, b in zip(got, reference)) if len(got) == len(reference)
            else None)
    try:
        same = replicas < 2 or max_diff(weights(work, 0), weights(work, 1)) == 0.0
    except OSError:
        same = False
    return {"exit 0": r["exit"] == 0,
            "steps once": [x["step"] for x in rows] == list(range(1, STEPS + 1)),
            "global batch": bool(rows) and all(x["global_batch"] == BATCH for x in rows),
            "losses equal": diff is not None and diff <= TOLERANCE,
            "replicas bitwise equal": same,
            "twice within bound": r["twice"] is not None and r["twice"] <= twice_allowed}, diff


# -- the faults ---------------------------------------------------------------------------------
def spare_lost(work, data_dir, rng):
    o = overrides(data_dir, "multi_worker_mirrored")
    spare_at, host_at = rng.randint(8, 30), rng.randint(45, 80)
    with NetCluster(4, rate="1gbit") as net:
        run = launch(net, work, o, workers=(0, 1), spares=(2, 3))
        killed = None
        if run.wait(lambda: steps_done(work) >= spare_at):
            lose(net, [2])
            if run.wait(lambda: steps_done(work) >= host_at):
                killed = lose(net, [1])
        r = outcome(run, work, killed)
    out = r["output"]
    r.update(fault=f"spare host 2 at step {spare_at}, host 1 at step {host_at}",
             checks={"spare's loss said": "the spare host 10.213.0.3 is lost" in out,
                     "no restart for it": out.count("tfdist launch: started") == 2,
                     "second spare took over": "the spare host 10.213.0.4 takes its place" in out,
                     "state from memory": r["resumed"][-1:] == [("memory", r["resumed"][-1][1])]
                     if r["resumed"] else False})
    return r, 0


def owner_and_peer(work, data_dir, rng):
    o = overrides(data_dir, "horovod", zero=3)
    at = rng.randint(12, 60)
    with NetCluster(5, rate="1gbit") as net:
        run = launch(net, work, o, workers=(1, 2), spares=(3, 4))
        killed = None
        if run.wait(lambda: steps_done(work) >= at):
            killed = lose(net, [1, 2])
            at = steps_done(work)
        r = outcome(run, work, killed)
    disk = r["resumed"][-1] if r["resumed"] else None
    # the newest backup on disk at the kill: the last every EVERY steps, or the one before it
    # when its write was still in flight (asynchronous backups)
    r.update(fault=f"hosts 1 and 2 together at step {at}",
             checks={"from the disk backup": bool(disk) and disk[0] == "disk"
                     and disk[1] % EVERY == 0 and 0 <= at - disk[1] <= EVERY,
                     "both spares took over": r["output"].count("takes its place") == 2})
    return r, EVERY  # the steps since the newest disk backup run again


def during_transfer(work, data_dir, rng):
    o = overrides(data_dir, "multi_worker_mirrored")
    at = rng.randint(12, 60)
    with NetCluster(4, rate="1gbit") as net:
        net.shape(2, rate="2mbit")  # the first spare's link: the state takes seconds to send
        run = launch(net, work, o, workers=(0, 1), spares=(2, 3))
        killed, queued = None, 0
        if run.wait(lambda: steps_done(work) >= at):
            lose(net, [1])
            at = steps_done(work)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not queued and run.p.poll() is None:
                plans = re.findall(r"state: step \d+ from the memory of the keeper\(s\) at (\S+)",
                                   "".join(run.out))
                if plans:
                    queued = _sending(net, 0, plans[-1], net.address(2))
                time.sleep(0.05)
            if queued:
                killed = lose(net, [2])
        r = outcome(run, work, killed)
    r.update(fault=f"host 1 at step {at}, then host 2 while {queued} bytes were queued to it",
             checks={"killed while sending": queued > 0,
                     "second spare took over": "the spare host 10.213.0.4 takes its place"
                     in r["output"],
                     "state from memory": bool(r["resumed"]) and r["resumed"][-1][0] == "memory"})
    return r, 0


def _sending(net, host, keeper, to):
    """Bytes queued on a connection of the keeper at `keeper` (on host `host`) to address `to`
    (`ss`'s Send-Q), 0 if none: the keeper is sending the state to `to`."""
    p = subprocess.run(net.command(host, ["ss", "-tn", "state", "established"]),
                       capture_output=True, text=True, timeout=10)
    queued = 0
    for line in p.stdout.splitlines()[1:]:
        cols = line.split()  # Recv-Q Send-Q Local Peer
        if len(cols) >= 4 and cols[2] == keeper and cols[3].rsplit(":", 1)[0] == to:
            queued = max(queued, int(cols[1]))
    return queued


FAULTS = {"spare_lost": spare_lost, "owner_and_peer": owner_and_peer,
          "during_transfer": during_transfer}


def reference_losses(tmp, data_dir, o):
    """The losses of an uninterrupted run of `o` on this machine's loopback."""
    work = os.path.join(tmp, "reference")
    p = subprocess.run([sys.executable, "-m", "tfdist", "launch", "--workers=2",
                        f"--strategy={o['strategy.name']}", "--max_restarts=0", "--",
                        sys.executable, DRIVER, work, json.dumps(o)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    if p.returncode:
        sys.exit(f"the uninterrupted run failed: {p.stdout[-2000:]}{p.stderr[-2000:]}")
    return losses(work)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fault", choices=sorted(FAULTS), required=True)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or os.path.join(ROOT, "bench_results", f"chaos-spares-{args.fault}.json")
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="tfdist-spares-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    strategy, zero = {"owner_and_peer": ("horovod", 3)}.get(args.fault,
                                                            ("multi_worker_mirrored", 0))
    reference = reference_losses(tmp, data_dir, overrides(data_dir, strategy, zero))
    rows = []
    for k in range(args.trials):
        work = os.path.join(tmp, f"trial{k}")
        t = time.monotonic()
        r, allowed = FAULTS[args.fault](work, data_dir, rng)
        with open(work + ".log", "w") as f:
            f.write(r["output"])
        checks, diff = verdict(r, work, reference, allowed)
        checks.update(r["checks"])
        rows.append({"trial": k, "fault": r["fault"], "resumed": r["resumed"],
                     "resume_s": r["resume_s"], "steps_twice": r["twice"], "exit": r["exit"],
                     "max_loss_diff": diff, **{c.replace(" ", "_").replace("'", ""): v
                                               for c, v in checks.items()},
                     "wall_s": round(time.monotonic() - t, 1), "passed": all(checks.values())})
        print(json.dumps(rows[-1]), flush=True)
        if not rows[-1]["passed"]:
            print(f"{r['output'][-3000:]}\n(all of it: {work}.log)", flush=True)
    head = ("trial", "fault", "resumed", "first step after", "twice", "exit", "loss diff",
            "wall", "passed")
    return report(rows, head, lambda x: (
        x["trial"], x["fault"], ", ".join(f"{w} {s}" for w, s in x["resumed"]),
        f"{x['resume_s']} s", x["steps_twice"], x["exit"],
        "-" if x["max_loss_diff"] is None else f"{x['max_loss_diff']:.1e}",
        f"{x['wall_s']:.0f} s", yes(x["passed"])), f"{strategy} (ZeRO-{zero})", out,
        fault=args.fault, steps=STEPS, backup_every=EVERY, batch=BATCH, tolerance=TOLERANCE,
        seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
