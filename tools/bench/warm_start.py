"""Warm workers against cold ones, in one run: the time from `tfdist launch` to the first step,
and from a killed worker to the first step of the restarted group (this machine, loopback).

    python tools/bench/warm_start.py                 # MWMS then Horovod, 3 rounds (make bench-warm)
    python tools/bench/warm_start.py --strategy=horovod --rounds=5

Each round runs, alternately, `tfdist launch --workers=2` (warm: every process a fork of the
host's agent, which imported TensorFlow, Keras and tfdist once) and `tfdist launch --cold` (every
process imports them itself), twice:

* **Launch to first step** (`tfdist train`, gpt_nano, 10 steps): from the launcher's start to
  the start of the first step. Cold, the prepare step and then the workers import TensorFlow;
  warm, the agent alone, once.
* **Restart to first step**: the fault driver (gpt_nano, 60 steps, a backup every 5) as the
  workers; worker 1 SIGKILLs itself after step 30 (`--kill-at-step`), and the launcher restarts
  the group, which resumes from its keepers' memory (warm and cold alike). From the kill (the
  step's end, as logged) to the start of the first step of the restarted group. Also: the
  driver's own launch to its first step (a program: no prepare step, so cold and warm both wait
  for one import).
The ratios are cold over warm, within a round. Prints a table and writes
bench_results/warm-start.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.bench.common import host  # noqa: E402
from tools.faults.chaos_partition import prepare_data  # noqa: E402
from tools.faults.harness import DRIVER, metrics  # noqa: E402

STEPS, KILL_AT = 60, 30


def launch_trial(work, data_dir, strategy, cold):
    """`tfdist train` launched; (seconds to the first step, exit status, output)."""
    start = time.time()
    p = subprocess.run([sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
                        "--workers=2", "--max_restarts=0", *(["--cold"] if cold else []), "--",
                        "--config=configs/gpt_nano.py", f"--workdir={work}",
                        f"--config.data.data_dir={data_dir}", "--config.train.steps=10",
                        "--config.train.steps_per_epoch=10", "--config.train.eval_steps=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    rows = metrics(work)["steps"] if p.returncode == 0 else []
    first = round(rows[0]["time"] - rows[0]["step_time"] - start, 2) if rows else None
    return first, p.returncode, p.stdout[-3000:] + p.stderr[-2000:]


def trial(work, data_dir, strategy, cold):
    """One launch of the driver; (seconds to the first step, seconds from the kill to the first
    step after it, exit status)."""
    o = {"data.data_dir": data_dir, "strategy.name": strategy, "train.steps": STEPS,
         "train.steps_per_epoch": 30, "train.batch_size": 16, "train.eval_steps": 2,
         "backup.every_steps": 5}
    start = time.time()
    p = subprocess.run([sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
                        "--workers=2", "--max_restarts=1", "--backoff=0",
                        *(["--cold"] if cold else []), "--", sys.executable, DRIVER, work,
                        json.dumps(o), "--kill-at-step", str(KILL_AT), "--kill-worker", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    rows = metrics(work)["steps"] if p.returncode == 0 else []
    if not rows:
        return None, None, p.returncode, p.stdout[-3000:] + p.stderr[-2000:]
    begin = {r["step"]: r["time"] - r["step_time"] for r in rows}
    killed = next(r["time"] for r in rows if r["step"] == KILL_AT)
    return (round(begin[1] - start, 2), round(begin[KILL_AT + 1] - killed, 2), p.returncode,
            p.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strategy", default="multi_worker_mirrored,horovod")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tfdist-warm-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    rows = []
    for strategy in args.strategy.split(","):
        for k in range(args.rounds):
            for cold in (False, True):
                work = os.path.join(tmp, f"{strategy}-{k}-{'cold' if cold else 'warm'}")
                launched, code1, out1 = launch_trial(work + "-train", data_dir, strategy, cold)
                first, restart, code, out = trial(work, data_dir, strategy, cold)
                rows.append({"strategy": strategy, "round": k, "start": "cold" if cold else "warm",
                             "launch_to_first_step_s": launched,
                             "restart_to_first_step_s": restart,
                             "program_launch_to_first_step_s": first, "exit": code or code1})
                print(json.dumps(rows[-1]), flush=True)
                for c, o in ((code1, out1), (code, out)):
                    if c:
                        print(o, flush=True)
    summary = {}
    for strategy in args.strategy.split(","):
        for what in ("launch_to_first_step_s", "restart_to_first_step_s",
                     "program_launch_to_first_step_s"):
            pairs = [(w[what], c[what]) for w, c in zip(
                [r for r in rows if r["strategy"] == strategy and r["start"] == "warm"],
                [r for r in rows if r["strategy"] == strategy and r["start"] == "cold"])
                if w[what] and c[what]]
            summary[f"{strategy} {what}"] = {
                "warm_median": statistics.median(w for w, _ in pairs) if pairs else None,
                "cold_median": statistics.median(c for _, c in pairs) if pairs else None,
                "cold_over_warm": [round(c / w, 2) for w, c in pairs]}
    print("\n| strategy | round | start | launch to first step | restart to first step | a "
          "program's launch |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['round']} | {r['start']} | {r['launch_to_first_step_s']} s "
              f"| {r['restart_to_first_step_s']} s | {r['program_launch_to_first_step_s']} s |")
    print("\n| strategy, what | warm (median) | cold (median) | cold / warm, per round |\n"
          "|---|---|---|---|")
    for name, x in summary.items():
        print(f"| {name} | {x['warm_median']} s | {x['cold_median']} s | "
              f"{', '.join(map(str, x['cold_over_warm']))} |")
    out = os.path.join(ROOT, "bench_results", "warm-start.json")
    with open(out, "w") as f:
        json.dump({"config": "configs/gpt_nano.py", "steps": STEPS, "kill_at_step": KILL_AT,
                   "workers": 2, "rows": rows, "summary": summary, "host": host()}, f, indent=1)
    print(f"wrote {out}")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
