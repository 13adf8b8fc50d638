"""Elastic trials: a host lost for good mid-run, then a new host offered, across
tools/cluster/netcluster.py's hosts (root).

    python tools/faults/chaos_elastic.py                       # MWMS, 5 trials (make chaos-elastic)
    python tools/faults/chaos_elastic.py --strategy=horovod --trials=5

3 hosts (network namespaces, 1 Gbit/s links). Each trial runs an elastic `tfdist launch` on host 0:
`--workers=2 --min_workers=1 --max_workers=2`, with a discovery command that prints the lines of
a file, at first hosts 0 and 1. gpt_nano trains STEPS steps (global batch 16, a backup every 5).
Once the run has logged a step chosen at random (seeded, 8-30), every process on host 1 is
SIGKILLed and its link cut for good (it stays in the discovery output: the launcher finds it
gone because it no longer answers). Once the job trains on 1 worker and has logged GROW_AT,
host 2 is added to the discovery output.

A trial passes when the launcher exits 0; the job trained on 1 worker within CONTINUE_BOUND
(60 s) of the kill; host 2 joined (2 replicas again) within JOIN_BOUND (60 s) of its offer;
every step 1..STEPS is in metrics.json once, each with the same global batch; and every step's
loss equals an uninterrupted 2-worker run's (on this machine's loopback) within 1e-5.

Prints a table and writes bench_results/chaos-elastic-<strategy>.json. Exit status 1 if a trial
fails.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.cluster.netcluster import NetCluster  # noqa: E402
from tools.faults.chaos_partition import prepare_data, report, uninterrupted, yes  # noqa: E402
from tools.faults.harness import metrics  # noqa: E402

STEPS = 200
EVERY = 5
BATCH = 16
GROW_AT = 50
CONTINUE_BOUND = 60.0  # seconds from the kill to a step trained by the smaller group
JOIN_BOUND = 60.0  # seconds from the offer of a host to its first step
TOLERANCE = 1e-5


def train_flags(work, data_dir, steps=STEPS):
    return ["--config=configs/gpt_nano.py", f"--workdir={work}",
            f"--config.data.data_dir={data_dir}",
            f"--config.train.steps={steps}", "--config.train.steps_per_epoch=50",
            f"--config.train.batch_size={BATCH}", "--config.train.eval_steps=2",
            f"--config.backup.every_steps={EVERY}"]


def rows(work):
    try:
        return metrics(work)["steps"]
    except (OSError, ValueError, KeyError):
        return []


def elastic_trial(net, work, data_dir, strategy, at_step, grow=True, steps=STEPS, timeout=900):
    """An elastic launch on host 0 over hosts 0 and 1 (host 2 offered later if `grow`); host 1
    killed and cut off for good once `at_step` is logged. Returns what happened (every wait is
    bounded; the launcher is killed at `timeout`)."""
    hosts_file = os.path.join(os.path.dirname(str(work)),
                              f"{os.path.basename(str(work))}-hosts.txt")
    with open(hosts_file, "w") as f:
        f.write(f"{net.address(0)}:1\n{net.address(1)}:1\n")
    env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1"}
    p = net.popen(0, [sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
                      "--workers=2", "--min_workers=1", "--max_workers=2",
                      f"--discovery=cat {hosts_file}", "--rejoin_timeout=10",
                      "--discovery_interval=1", "--max_restarts=2", "--backoff=1", "--",
                      *train_flags(work, data_dir, steps)],
                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = Follow(p, work, timeout)
    r = {"cut_at": None, "continued_s": None, "offered_at": None, "joined_at": None,
         "joined_s": None}
    last, wait = run.last, run.wait
    if wait(lambda: last()["step"] >= at_step):
        r["cut_at"] = last()["step"]
        killed = time.time()
        net.kill(1)
        net.partition(1)
        if wait(lambda: any(x["replicas"] == 1 for x in rows(work))):
            r["continued_s"] = run.started_alone(killed)
            if grow and wait(lambda: last()["step"] >= GROW_AT):
                r["offered_at"] = last()["step"]
                with open(hosts_file, "a") as f:
                    f.write(f"{net.address(2)}:1\n")
                offered = time.time()
                if wait(lambda: last()["replicas"] == 2):
                    joined = next(x for x in rows(work)
                                  if x["step"] > r["offered_at"] and x["replicas"] == 2)
                    r["joined_at"] = joined["step"]
                    r["joined_s"] = round(joined["time"] - joined["step_time"] - offered, 1)
    r.update(run.end())
    return r


class Follow:
    """A launcher `p` (its output read as it comes) and its run's metrics.json in `work`, for at
    most `timeout` seconds: every wait is bounded, and at the end the launcher is killed."""

    def __init__(self, p, work, timeout):
        self.p, self.work, self.out = p, work, []
        self.reader = threading.Thread(target=lambda: self.out.extend(p.stdout), daemon=True)
        self.reader.start()
        self.deadline = time.monotonic() + timeout

    def last(self):
        """The newest step logged (step 0 before the first)."""
        return (rows(self.work) or [{"step": 0, "replicas": 0}])[-1]

    def wait(self, condition):
        """Whether `condition()` came true before the launcher ended or the deadline."""
        while not condition():
            if self.p.poll() is not None or time.monotonic() > self.deadline:
                return False
            time.sleep(0.1)
        return True

    def started_alone(self, since):
        """Seconds from `since` (time.time()) to the start of the first step logged at 1
        worker."""
        first = next(x for x in rows(self.work) if x["replicas"] == 1)
        return round(first["time"] - first["step_time"] - since, 1)

    def end(self):
        """Waits until the launcher ends (or the deadline: it is killed); what it left, with the
        steps it said it resumed at (each process's line)."""
        self.wait(lambda: False)
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        self.reader.join(timeout=10)
        output = "".join(self.out)
        return {"exit": self.p.returncode, "output": output, "rows": rows(self.work),
                "resumed_at": [int(s) for s in re.findall(
                    r"resuming from \S+ at step (\d+) of", output)]}


def verdict(r, reference, steps=STEPS, grow=True):
    """The checks of a trial (module doc), by name."""
    logged = r["rows"]
    diff = (max(abs(a["loss"] - b) for a, b in zip(logged, reference))
            if len(logged) == len(reference) else None)
    checks = {
        "exit 0": r["exit"] == 0,
        "continued within bound": (r["continued_s"] is not None
                                   and r["continued_s"] <= CONTINUE_BOUND),
        "steps once": [x["step"] for x in logged] == list(range(1, steps + 1)),
        "global batch constant": bool(logged) and all(x["global_batch"] == BATCH for x in logged),
        "losses equal": diff is not None and diff <= TOLERANCE,
    }
    if grow:
        checks["joined within bound"] = r["joined_s"] is not None and r["joined_s"] <= JOIN_BOUND
    return checks, diff


def arguments(doc, prefix):
    """The chaos tools' flags (--strategy, --trials, --seed, --out); --out's default is
    bench_results/<prefix>-<strategy>.json."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--strategy", default="multi_worker_mirrored",
                    choices=["multi_worker_mirrored", "horovod"])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench_results", f"{prefix}-{args.strategy}.json")
    return args


def trials(args, trial, steps=STEPS, extra=None, more_checks=None, **facts):
    """`args.trials` runs of `trial(work, data_dir, strategy, at_step)` (a dict as
    `elastic_trial`'s), each checked against one uninterrupted run; `extra(r)`: more columns
    ({name: a list}); `more_checks(r)`: more checks ({name: bool}). Prints the table, writes
    args.out; 0 if every trial passed, else 1."""
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="tfdist-elastic-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    ref = os.path.join(tmp, "reference")
    uninterrupted(ref, data_dir, args.strategy, flags=train_flags(ref, data_dir, steps))
    reference = [x["loss"] for x in rows(ref)]
    table = []
    for k in range(args.trials):
        work = os.path.join(tmp, f"trial{k}")
        at = rng.randint(8, 30)
        t = time.monotonic()
        r = trial(work, data_dir, args.strategy, at)
        with open(work + ".log", "w") as f:
            f.write(r["output"])
        checks, diff = verdict(r, reference, steps=steps)
        checks.update(more_checks(r) if more_checks else {})
        table.append({"trial": k, "kill_at_step": r["cut_at"], "resumed_at": r["resumed_at"],
                      "continued_on_1_after_s": r["continued_s"],
                      "offered_at_step": r["offered_at"],
                      "joined_at_step": r["joined_at"], "joined_after_s": r["joined_s"],
                      **(extra(r) if extra else {}), "exit": r["exit"],
                      "max_loss_diff": diff, **{k.replace(" ", "_"): v for k, v in checks.items()},
                      "wall_s": round(time.monotonic() - t, 1), "passed": all(checks.values())})
        print(json.dumps(table[-1]), flush=True)
        if not table[-1]["passed"]:
            print(f"{r['output'][-3000:]}\n(all of it: {work}.log)", flush=True)
    names = list(extra(r)) if extra else []
    head = ("trial", "kill at", "resumed at", "on 1 after", "offered at", "on 2 at", "on 2 after",
            *[n.replace("_", " ") for n in names], "exit", "steps once", "batch", "loss diff",
            "wall", "passed")
    return report(table, head, lambda x: (
        x["trial"], x["kill_at_step"], ",".join(map(str, x["resumed_at"])),
        f"{x['continued_on_1_after_s']} s", x["offered_at_step"], x["joined_at_step"],
        f"{x['joined_after_s']} s", *[",".join(map(str, x[n])) for n in names], x["exit"],
        yes(x["steps_once"]), yes(x["global_batch_constant"]),
        "-" if x["max_loss_diff"] is None else f"{x['max_loss_diff']:.1e}", f"{x['wall_s']:.0f} s",
        yes(x["passed"])), args.strategy, args.out, steps=steps, backup_every=EVERY, batch=BATCH,
        bound_s=CONTINUE_BOUND, join_bound_s=JOIN_BOUND, tolerance=TOLERANCE, seed=args.seed,
        **facts)


def main():
    args = arguments(__doc__, "chaos-elastic")

    def trial(work, data_dir, strategy, at):
        with NetCluster(3, rate="1gbit") as net:
            return elastic_trial(net, work, data_dir, strategy, at)
    return trials(args, trial)


if __name__ == "__main__":
    sys.exit(main())
