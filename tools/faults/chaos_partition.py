"""Partition trials: a host cut off from the others mid-run, across tools/cluster/netcluster.py's
hosts.

    python tools/faults/chaos_partition.py              # MWMS: 3 trials of 10 s, 3 of 60 s
    python tools/faults/chaos_partition.py --strategy=horovod --seconds=10,60 --trials=3

2 hosts (network namespaces, 1 Gbit/s links; root). Each trial runs `tfdist launch
--hosts=<both> --workers=2` on host 0 (40 steps of gpt_nano, a backup every 5 steps), and once
the run has logged a step chosen at random (seeded, 8-30), cuts one host off (host 1 and host 0
in turn: every packet dropped both ways, no error to the sender) for the given seconds, then
heals it. What happens (docs/deployment.md, "Several hosts ..., and network faults"): the
synchronous strategies detect the loss (MWMS: TF's coordination service, 10 s without a
heartbeat; Horovod: its Gloo timeout, 30 s), every process exits, and the launcher restarts the
group, which waits for the host and resumes from the newest backup. A short partition may also
pass unnoticed (TCP retransmits).

A trial passes when the launcher exits 0, every step 1..40 is logged once, the final weights are
bitwise those of an uninterrupted run on this machine's loopback, and training moved past the
partitioned step within PARTITION_BOUND (120 s) of the partition's end: no hang.

Prints a table and writes bench_results/chaos-partition-<strategy>.json. Exit status 1 if a trial
fails.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.cluster.netcluster import NetCluster  # noqa: E402
from tools.faults.harness import final_weights, launch_argv, max_diff, metrics  # noqa: E402

PARTITION_BOUND = 120  # seconds after the partition's end by which training must move on
STEPS = 40
EVERY = 5


def train_flags(work, data_dir, steps=STEPS):
    return ["--config=configs/gpt_nano.py", f"--workdir={work}",
            f"--config.data.data_dir={data_dir}",
            f"--config.train.steps={steps}", "--config.train.steps_per_epoch=10",
            "--config.train.batch_size=16", "--config.train.eval_steps=2",
            f"--config.backup.every_steps={EVERY}"]


def logged_steps(work):
    try:
        return [r["step"] for r in metrics(work)["steps"]]
    except (OSError, ValueError, KeyError):
        return []


def uninterrupted(work, data_dir, strategy, steps=STEPS, flags=None):
    """The reference: the same run on this machine's loopback (`tfdist launch`), never cut."""
    p = subprocess.run(launch_argv(flags or train_flags(work, data_dir, steps), strategy=strategy,
                                   max_restarts=0), cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    if p.returncode:
        raise RuntimeError(f"the uninterrupted run failed:\n{p.stdout[-3000:]}{p.stderr[-2000:]}")


def progress(work):
    """(the newest logged step, steps run by each worker so far or None), from metrics.json."""
    try:
        r = metrics(work)["steps"][-1]
        return r["step"], r.get("worker_steps")
    except (OSError, ValueError, KeyError, IndexError):
        return 0, None


def partition_trial(net, work, data_dir, host, at_step, seconds, strategy="multi_worker_mirrored",
                    steps=STEPS, max_restarts=4, launch=None, flags=None):
    """`tfdist launch --hosts=<every host of net>` on host 0 (`launch`: its task counts, by default
    one worker per host; `flags`: the training flags, by default `train_flags`); once the run has
    logged `at_step`, host `host` is cut off for `seconds`, then healed. Returns {"exit", "output",
    "cut_at" (the logged step then), "moved_on_s" (seconds from the heal until a later step was
    logged, None if never), "at_cut", "at_heal", "at_end" (`progress` then), "longest_stall_s"
    (the longest time without a new logged step, from the cut)}. Every wait is bounded."""
    env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1"}
    hosts = ",".join(net.address(i) for i in range(net.n))
    p = net.popen(0, [sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
                      f"--hosts={hosts}", *(launch or [f"--workers={net.n}"]),
                      f"--max_restarts={max_restarts}", "--backoff=1", "--",
                      *(flags or train_flags(work, data_dir, steps))],
                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    reader = threading.Thread(target=lambda: out.extend(p.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 600
    while progress(work)[0] < at_step:
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            reader.join(timeout=10)
            return {"exit": p.wait(), "output": "".join(out), "cut_at": None, "moved_on_s": None,
                    "at_cut": None, "at_heal": None, "at_end": progress(work),
                    "longest_stall_s": None}
        time.sleep(0.05)
    at_cut = progress(work)
    net.partition(host)
    cut = last_new = time.monotonic()
    last = at_cut[0]
    stall = 0.0

    def watch():  # the longest time without a new logged step
        nonlocal last, last_new, stall
        now = time.monotonic()
        step = progress(work)[0]
        if step > last:
            last, last_new = step, now
        stall = max(stall, now - last_new)
        time.sleep(0.2)

    while time.monotonic() - cut < seconds and p.poll() is None:
        watch()
    net.heal(host)
    at_heal = progress(work)
    healed = time.monotonic()
    moved_on = None
    end = healed + PARTITION_BOUND + 600
    while p.poll() is None and time.monotonic() < end:
        if moved_on is None and progress(work)[0] > at_cut[0]:
            moved_on = time.monotonic() - healed
        watch()
    if p.poll() is None:
        p.kill()
    p.wait()
    reader.join(timeout=10)
    if moved_on is None and progress(work)[0] > at_cut[0]:
        moved_on = 0.0  # it moved on before the heal (or in the last 0.2 s)
    return {"exit": p.returncode, "output": "".join(out), "cut_at": at_cut[0],
            "moved_on_s": moved_on, "at_cut": at_cut, "at_heal": at_heal, "at_end": progress(work),
            "longest_stall_s": round(stall, 1)}


# The parameter server: 4 hosts (chief, 2 workers, ps), long enough that a 60 s cut ends mid-run.
PS_STEPS = 1200
PS_EPOCH = 100
PS_LAUNCH = ["--workers=2", "--ps=1"]


def ps_flags(work, data_dir, steps=PS_STEPS):
    return ["--config=configs/gpt_nano.py", f"--workdir={work}",
            f"--config.data.data_dir={data_dir}",
            f"--config.train.steps={steps}", f"--config.train.steps_per_epoch={PS_EPOCH}",
            "--config.train.eval_steps=2", "--config.backup.every_steps=50"]


DETECTION_S = 2 * 5.0  # 2 x the plugin's default keepalive_secs: a lost worker is noticed by then


def ps_verdict(r, worker, seconds, steps=PS_STEPS):
    """What a parameter-server trial shows: worker `worker` (of 2) was cut off for `seconds`. The
    run ends with every step counted once, the cut-off worker trains again after the heal, and no
    stretch without a logged step exceeds PARTITION_BOUND. A cut that outlasts the detection
    (2 x keepalive_secs) by 10 s must also leave the reachable worker training during it; a
    shorter one may hold a barrier (a backup, an epoch end) until it heals."""
    other = 1 - worker
    at_cut, at_heal, at_end = r["at_cut"], r["at_heal"], r["at_end"]
    counted = f"{steps:,} steps run" in r["output"] or f"(step {steps} of {steps})" in r["output"]
    kept_on = bool(at_cut and at_heal and at_heal[1] and at_heal[1][other] > at_cut[1][other])
    back = bool(at_heal and at_end[1] and at_end[1][worker] > at_heal[1][worker])
    must_keep_on = seconds >= DETECTION_S + 10
    return {"counted": counted and at_end[0] == steps, "reachable_trained_during_cut": kept_on,
            "cut_off_trained_after_heal": back,
            "passed": (r["exit"] == 0 and counted and at_end[0] == steps and back and
                       (kept_on or not must_keep_on) and r["longest_stall_s"] is not None and
                       r["longest_stall_s"] <= PARTITION_BOUND)}


def prepare_data(directory):
    from tfdist import config
    from tfdist.data import open_store
    c = config.default_config()
    c.data.data_dir = directory
    open_store(c.data, progress=False)
    return directory


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--strategy", default="multi_worker_mirrored",
                    choices=["multi_worker_mirrored", "horovod", "parameter_server"])
    ap.add_argument("--seconds", default="10,60", help="partition lengths, comma-separated")
    ap.add_argument("--trials", type=int, default=3, help="per partition length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or os.path.join(ROOT, "bench_results", f"chaos-partition-{args.strategy}.json")
    if args.strategy == "parameter_server":
        return ps_trials(args, out)
    rng = random.Random(args.seed)
    rows = []
    tmp = tempfile.mkdtemp(prefix="tfdist-partition-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    ref = os.path.join(tmp, "reference")
    uninterrupted(ref, data_dir, args.strategy)
    reference = final_weights(ref)
    trial = 0
    for seconds in [float(s) for s in args.seconds.split(",")]:
        for _ in range(args.trials):
            host = trial % 2 == 0 and 1 or 0
            at = rng.randint(8, 30)
            work = os.path.join(tmp, f"trial{trial}")
            t = time.monotonic()
            with NetCluster(2, rate="1gbit") as net:
                r = partition_trial(net, work, data_dir, host, at, seconds, args.strategy)
            wall = time.monotonic() - t
            steps = logged_steps(work)
            same = (r["exit"] == 0 and os.path.exists(os.path.join(work, "model.keras")) and
                    max_diff(final_weights(work), reference) == 0.0)
            restarts = r["output"].count("tfdist launch: started") - 1
            lost = "lost its" in r["output"]
            ok = (r["exit"] == 0 and steps == list(range(1, STEPS + 1)) and same and
                  r["moved_on_s"] is not None and r["moved_on_s"] <= PARTITION_BOUND)
            rows.append({"trial": trial, "seconds": seconds, "host": host,
                         "cut_at_step": r["cut_at"], "exit": r["exit"], "restarts": restarts,
                         "detected": lost,
                         "moved_on_after_heal_s": (None if r["moved_on_s"] is None
                                                   else round(r["moved_on_s"], 1)),
                         "steps_logged_once": steps == list(range(1, STEPS + 1)),
                         "bitwise_equal": same, "wall_s": round(wall, 1), "passed": ok})
            print(json.dumps(rows[-1]), flush=True)
            if not ok:
                print(r["output"][-4000:], flush=True)
            trial += 1
    head = ("trial", "partition", "host", "cut at step", "exit", "restarts", "detected",
            "moved on after heal", "steps once", "bitwise", "wall", "passed")
    return report(rows, head, lambda r: (
        r["trial"], f"{r['seconds']:g} s", r["host"], r["cut_at_step"], r["exit"], r["restarts"],
        "yes" if r["detected"] else "no", f"{r['moved_on_after_heal_s']} s",
        yes(r["steps_logged_once"]), yes(r["bitwise_equal"]), f"{r['wall_s']:.0f} s",
        yes(r["passed"])), args.strategy, out, steps=STEPS, backup_every=EVERY, seed=args.seed)


def yes(flag):
    return "yes" if flag else "NO"


def report(rows, head, cells, strategy, out, **facts):
    """Prints the trials' table and writes them to `out` (JSON); 0 if every trial passed, else 1."""
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(c) for c in cells(r)) + " |")
    passed = sum(r["passed"] for r in rows)
    print(f"\n{passed} of {len(rows)} trials passed ({strategy})")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    with open(out, "w") as f:
        json.dump({"strategy": strategy, "bound_s": PARTITION_BOUND, "link": "1gbit", **facts,
                   "commit": commit, "trials": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0 if passed == len(rows) else 1


def ps_trials(args, out):
    """The parameter server's trials: 4 hosts, worker 0's host and worker 1's in turn cut off at
    a seeded step; judged by `ps_verdict` (there is no bitwise reference: asynchronous)."""
    rng = random.Random(args.seed)
    rows = []
    tmp = tempfile.mkdtemp(prefix="tfdist-partition-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    trial = 0
    for seconds in [float(s) for s in args.seconds.split(",")]:
        for _ in range(args.trials):
            worker = trial % 2
            at = rng.randint(100, 300)
            work = os.path.join(tmp, f"trial{trial}")
            t = time.monotonic()
            with NetCluster(4, rate="1gbit") as net:  # chief, worker 0, worker 1, ps
                r = partition_trial(net, work, data_dir, 1 + worker, at, seconds,
                                    "parameter_server", launch=PS_LAUNCH,
                                    flags=ps_flags(work, data_dir))
            v = ps_verdict(r, worker, seconds)
            rows.append({"trial": trial, "seconds": seconds, "worker_cut": worker,
                         "cut_at_step": r["cut_at"], "exit": r["exit"],
                         "worker_steps_at_cut": r["at_cut"] and r["at_cut"][1],
                         "worker_steps_at_heal": r["at_heal"] and r["at_heal"][1],
                         "worker_steps_at_end": r["at_end"][1],
                         "detected": "failed with UnavailableError" in r["output"],
                         "worker_restarts": r["output"].count("restarting it alone"),
                         "longest_stall_s": r["longest_stall_s"], **v,
                         "wall_s": round(time.monotonic() - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
            if not v["passed"]:
                print(r["output"][-4000:], flush=True)
            trial += 1
    head = ("trial", "partition", "worker cut", "cut at step", "worker steps at cut / heal / end",
            "detected", "longest stall", "counted", "exit", "passed")
    return report(rows, head, lambda r: (
        r["trial"], f"{r['seconds']:g} s", r["worker_cut"], r["cut_at_step"],
        f"{r['worker_steps_at_cut']} / {r['worker_steps_at_heal']} / {r['worker_steps_at_end']}",
        "yes" if r["detected"] else "no", f"{r['longest_stall_s']} s",
        PS_STEPS if r["counted"] else "NO", r["exit"], yes(r["passed"])), "parameter_server", out,
        steps=PS_STEPS, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
