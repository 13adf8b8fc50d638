"""Chaos trials for `tfdist launch`: SIGKILL a worker at a random step and check the run's end.

    python tools/chaos.py                       # 5 trials, 2 workers, gpt_nano, 30 steps
    python tools/chaos.py --trials=10 --seed=1 --workers=3

First one uninterrupted run is the reference. Then each trial picks a step at random (seeded)
and a worker in turn (worker 0, the chief, first). That worker SIGKILLs itself right after the step (tools/faulty_train.py), the launcher
stops the group and restarts it, and training resumes from the backup. A backup is written after
every step, with op determinism and dropout on. A trial passes when the launcher exits 0 after
exactly one restart, every worker executed exactly the planned steps (none lost, none repeated),
and the final weights are bitwise equal to the reference's. Prints a table and writes
bench_results/chaos.json. Exit status 1 if any trial fails.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tools", "faulty_train.py")
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def launch(workdir, overrides, workers, *extra):
    cmd = [sys.executable, "-m", "tfdist", "launch", f"--workers={workers}", "--max_restarts=2",
           "--backoff=0.5", "--", sys.executable, DRIVER, workdir, json.dumps(overrides), *extra]
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    return p, time.monotonic() - t


def steps_by_worker(workdir):
    counts = {}
    for line in open(os.path.join(workdir, "executed_steps.txt")):
        w = int(line.split()[0])
        counts[w] = counts.get(w, 0) + 1
    return counts


def final_weights(workdir):
    import keras
    import numpy as np
    import tfdist.models.gpt  # noqa: F401  (registers the model classes)
    m = keras.saving.load_model(os.path.join(workdir, "model.keras"), compile=False)
    return [np.asarray(w) for w in m.weights]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--data_dir", default="", help="TFDS data_dir (default ~/tensorflow_datasets)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "chaos.json"))
    args = ap.parse_args()
    if args.steps < 4 or args.steps % 10 or args.workers < 1 or args.trials < 1:
        ap.error("--steps must be a multiple of 10 (>= 10); --workers and --trials >= 1")

    overrides = {"train.steps": args.steps, "train.steps_per_epoch": 10, "train.batch_size": 16,
                 "train.deterministic": True, "train.eval_steps": 2, "model.dropout": 0.1,
                 "backup.every_steps": 1, "strategy.name": "multi_worker_mirrored"}
    if args.data_dir:
        overrides["data.data_dir"] = args.data_dir
    plan = {w: args.steps for w in range(args.workers)}
    tmp = tempfile.mkdtemp(prefix="tfdist-chaos-")
    ref_dir = os.path.join(tmp, "reference")
    p, seconds = launch(ref_dir, overrides, args.workers)
    if p.returncode or steps_by_worker(ref_dir) != plan:
        sys.exit(f"chaos: the reference run failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}")
    reference = final_weights(ref_dir)
    print(f"reference: {args.workers} workers, {args.steps} steps, {seconds:.1f} s", flush=True)

    rng = random.Random(args.seed)
    rows = []
    for trial in range(args.trials):
        worker, step = trial % args.workers, rng.randint(1, args.steps - 1)  # chief, then others
        d = os.path.join(tmp, f"trial{trial}")
        p, seconds = launch(d, overrides, args.workers, "--kill-at-step", str(step),
                            "--kill-worker", str(worker))
        restarts = p.stdout.count("tfdist launch: started") - 1
        executed = steps_by_worker(d) if os.path.exists(os.path.join(d, "executed_steps.txt")) else {}
        diff = None
        if p.returncode == 0:
            diff = max(float(abs(a - b).max()) for a, b in zip(final_weights(d), reference))
        resumed = f"resuming from {d}/backup at step {step} of {args.steps}" in p.stdout
        ok = p.returncode == 0 and restarts == 1 and executed == plan and resumed and diff == 0.0
        rows.append({"trial": trial, "killed_worker": worker, "kill_after_step": step,
                     "exit": p.returncode, "restarts": restarts, "resumed_at_kill_step": resumed,
                     "executed_steps": executed, "planned_steps": args.steps,
                     "max_abs_weight_diff": diff, "seconds": round(seconds, 1), "ok": ok})
        if not ok:
            print(p.stdout[-3000:], p.stderr[-2000:], sep="\n")
        print(f"trial {trial}: {'ok' if ok else 'FAILED'}", flush=True)

    head = ("trial", "killed", "after step", "exit", "restarts", "executed (per worker)", "planned",
            "max |dw|", "s", "ok")
    table = [head] + [(r["trial"], f"w{r['killed_worker']}", r["kill_after_step"], r["exit"],
                       r["restarts"], "/".join(str(r["executed_steps"].get(w, 0))
                                               for w in range(args.workers)),
                       r["planned_steps"], r["max_abs_weight_diff"], r["seconds"],
                       "yes" if r["ok"] else "NO") for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"workers": args.workers, "steps": args.steps, "seed": args.seed,
                   "trials": rows}, f, indent=1)
    print(f"wrote {args.out}; {sum(r['ok'] for r in rows)} of {len(rows)} trials ok")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
