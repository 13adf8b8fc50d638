"""Partition trials: a host cut off from the others mid-run, across tools/netcluster.py's hosts.

    python tools/chaos_partition.py                               # MWMS: 3 trials of 10 s, 3 of 60 s
    python tools/chaos_partition.py --strategy=horovod --seconds=10,60 --trials=3

2 hosts (network namespaces, 1 Gbit/s links; root). Each trial runs `tfdist launch
--hosts=<both> --workers=2` on host 0 (40 steps of gpt_nano, a backup every 5 steps), and once
the run has logged a step chosen at random (seeded, 8-30), cuts one host off (host 1 and host 0
in turn: every packet dropped both ways, no error to the sender) for the given seconds, then
heals it. What happens (docs/deployment.md#faults): the synchronous strategies detect the loss
(MWMS: TF's coordination service, 10 s without a heartbeat; Horovod: its Gloo timeout, 30 s),
every process exits, and the launcher restarts the group, which waits for the host and resumes
from the newest backup. A short partition may also pass unnoticed (TCP retransmits).

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.netcluster import NetCluster  # noqa: E402

PARTITION_BOUND = 120  # seconds after the partition's end by which training must move on
STEPS, EVERY = 40, 5


def train_flags(work, data_dir, steps=STEPS):
    return ["--config=configs/gpt_nano.py", f"--workdir={work}", f"--config.data.data_dir={data_dir}",
            f"--config.train.steps={steps}", "--config.train.steps_per_epoch=10",
            "--config.train.batch_size=16", "--config.train.eval_steps=2",
            f"--config.backup.every_steps={EVERY}"]


def logged_steps(work):
    try:
        with open(os.path.join(work, "metrics.json")) as f:
            return [r["step"] for r in json.load(f)["steps"]]
    except (OSError, ValueError, KeyError):
        return []


def uninterrupted(work, data_dir, strategy, steps=STEPS):
    """The reference: the same run on this machine's loopback (`tfdist launch`), never cut."""
    p = subprocess.run([sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
                        "--workers=2", "--max_restarts=0", "--", *train_flags(work, data_dir, steps)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"the uninterrupted run failed:\n{p.stdout[-3000:]}{p.stderr[-2000:]}")


def partition_trial(net, work, data_dir, host, at_step, seconds, strategy="multi_worker_mirrored",
                    steps=STEPS, max_restarts=4):
    """`tfdist launch --hosts=<every host of net>` on host 0; once the run has logged `at_step`,
    host `host` is cut off for `seconds`, then healed. Returns {"exit", "output", "cut_at" (the
    logged step then), "moved_on_s" (seconds from the heal until a later step was logged, None if
    never)}. Every wait is bounded."""
    env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1"}
    hosts = ",".join(net.address(i) for i in range(net.n))
    p = net.popen(0, [sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
                      f"--hosts={hosts}", f"--workers={net.n}", f"--max_restarts={max_restarts}",
                      "--backoff=1", "--", *train_flags(work, data_dir, steps)],
                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    reader = threading.Thread(target=lambda: out.extend(p.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 600
    while max(logged_steps(work), default=0) < at_step:
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            reader.join(timeout=10)
            return {"exit": p.wait(), "output": "".join(out), "cut_at": None, "moved_on_s": None}
        time.sleep(0.05)
    cut_at = max(logged_steps(work))
    net.partition(host)
    cut = time.monotonic()
    while time.monotonic() - cut < seconds and p.poll() is None:
        time.sleep(0.2)
    net.heal(host)
    healed, moved_on = time.monotonic(), None
    end = healed + PARTITION_BOUND + 600
    while p.poll() is None and time.monotonic() < end:
        if moved_on is None and max(logged_steps(work), default=0) > cut_at:
            moved_on = time.monotonic() - healed
        time.sleep(0.2)
    if p.poll() is None:
        p.kill()
    p.wait()
    reader.join(timeout=10)
    if moved_on is None and max(logged_steps(work), default=0) > cut_at:
        moved_on = 0.0  # it moved on before the heal (or in the last 0.2 s)
    return {"exit": p.returncode, "output": "".join(out), "cut_at": cut_at, "moved_on_s": moved_on}


def final_weights(work):
    import keras
    import numpy as np
    import tfdist.models.gpt  # noqa: F401  (registers the classes)
    m = keras.saving.load_model(os.path.join(work, "model.keras"), compile=False)
    return [np.asarray(w) for w in m.weights]


def prepare_data(directory):
    from tfdist import config
    from tfdist.data import open_store
    c = config.default_config()
    c.data.data_dir = directory
    open_store(c.data, progress=False)
    return directory


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="multi_worker_mirrored",
                    choices=["multi_worker_mirrored", "horovod"])
    ap.add_argument("--seconds", default="10,60", help="partition lengths, comma-separated")
    ap.add_argument("--trials", type=int, default=3, help="per partition length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np
    out = args.out or os.path.join(ROOT, "bench_results", f"chaos-partition-{args.strategy}.json")
    rng = random.Random(args.seed)
    rows, tmp = [], tempfile.mkdtemp(prefix="tfdist-partition-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    ref = os.path.join(tmp, "reference")
    uninterrupted(ref, data_dir, args.strategy)
    reference = final_weights(ref)
    trial = 0
    for seconds in [float(s) for s in args.seconds.split(",")]:
        for _ in range(args.trials):
            host, at = trial % 2 == 0 and 1 or 0, rng.randint(8, 30)
            work = os.path.join(tmp, f"trial{trial}")
            t = time.monotonic()
            with NetCluster(2, rate="1gbit") as net:
                r = partition_trial(net, work, data_dir, host, at, seconds, args.strategy)
            wall = time.monotonic() - t
            steps = logged_steps(work)
            same = (r["exit"] == 0 and os.path.exists(os.path.join(work, "model.keras")) and
                    max(float(np.max(np.abs(a - b))) for a, b in zip(final_weights(work), reference)) == 0.0)
            restarts = r["output"].count("tfdist launch: started") - 1
            lost = "lost its" in r["output"]
            ok = (r["exit"] == 0 and steps == list(range(1, STEPS + 1)) and same and
                  r["moved_on_s"] is not None and r["moved_on_s"] <= PARTITION_BOUND)
            rows.append({"trial": trial, "seconds": seconds, "host": host, "cut_at_step": r["cut_at"],
                         "exit": r["exit"], "restarts": restarts, "detected": lost,
                         "moved_on_after_heal_s": None if r["moved_on_s"] is None else round(r["moved_on_s"], 1),
                         "steps_logged_once": steps == list(range(1, STEPS + 1)),
                         "bitwise_equal": same, "wall_s": round(wall, 1), "passed": ok})
            print(json.dumps(rows[-1]), flush=True)
            if not ok:
                print(r["output"][-4000:], flush=True)
            trial += 1
    head = ("trial", "partition", "host", "cut at step", "exit", "restarts", "detected",
            "moved on after heal", "steps once", "bitwise", "wall", "passed")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['trial']} | {r['seconds']:g} s | {r['host']} | {r['cut_at_step']} | {r['exit']} | "
              f"{r['restarts']} | {'yes' if r['detected'] else 'no'} | {r['moved_on_after_heal_s']} s | "
              f"{'yes' if r['steps_logged_once'] else 'NO'} | {'yes' if r['bitwise_equal'] else 'NO'} | "
              f"{r['wall_s']:.0f} s | {'yes' if r['passed'] else 'NO'} |")
    passed = sum(r["passed"] for r in rows)
    print(f"\n{passed} of {len(rows)} trials passed ({args.strategy})")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"strategy": args.strategy, "steps": STEPS, "backup_every": EVERY, "seed": args.seed,
                   "bound_s": PARTITION_BOUND, "link": "1gbit", "commit": subprocess.run(
                       ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=ROOT).stdout.strip(), "trials": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
