"""Chaos trials for local-SGD islands (`make chaos-islands`): SIGKILL one island's worker between
two syncs and check that the other island goes on and the killed one rejoins.

    python tools/faults/chaos_islands.py                 # 5 trials, 2 islands of 1 worker
    python tools/faults/chaos_islands.py --trials=10 --seed=1

Each trial runs gpt_nano as `tfdist launch --workers=2 --islands=2` (a sync every 4 updates,
int8 deltas, a backup after every step, 16 steps) through tools/faults/faulty_train.py, which
SIGKILLs island I's worker right after step K (I in turn, K at random between two syncs, seeded).
A trial passes when the launcher exits 0; the other island ran its 16 steps once (one process,
never restarted); the killed island's launcher restarted it once, it resumed from its own backup
at step K, ran the 16 - K steps left, and rejoined the rounds (with the current outer weights if
rounds closed while it was down: "rejoining at round R"); and every island finished. Prints a
table and writes bench_results/chaos-islands.json. Exit status 1 if a trial fails.
"""
import argparse
import collections
import json
import os
import random
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import host  # noqa: E402
from tools.faults import harness  # noqa: E402

STEPS, SYNC_EVERY = 16, 4


def trial(workdir, island, step, data_dir):
    overrides = {"train.steps": STEPS, "train.steps_per_epoch": STEPS, "train.batch_size": 16,
                 "train.deterministic": True, "backup.every_steps": 1,
                 "strategy.name": "multi_worker_mirrored", "dp.islands": 2,
                 "dp.sync_every": SYNC_EVERY, "dp.exchange": "int8",
                 **({"data.data_dir": data_dir} if data_dir else {})}
    cmd = [sys.executable, "-m", "tfdist", "launch", "--workers=2", "--islands=2",
           "--max_restarts=1", "--backoff=0.5", "--",
           *harness.driver_argv(workdir, overrides, "--kill-at-step", str(step),
                                "--kill-island", str(island))]
    start = time.monotonic()
    p = harness.run_group(cmd, timeout=900)
    seconds = time.monotonic() - start
    out = p.stdout
    by_pid = collections.Counter(line.split()[1] for line in
                                 open(os.path.join(workdir, "executed_steps.txt")))
    other = 1 - island
    rejoined = re.search(rf"\[i{island}\] \[w0\] tfdist: island {island}: rejoining at round "
                         rf"(\d+)", out)
    resumed = f"[i{island}] [w0] tfdist: resuming from" in out and f" at step {step} of " in out
    checks = {
        "exit 0": p.returncode == 0,
        "other island once": f"[i{other}] tfdist launch: done: 1 worker(s) finished\n" in out,
        "killed island restarted once": (f"[i{island}] tfdist launch: done: 1 worker(s) "
                                         f"finished after 1 restart(s)") in out,
        "resumed at the kill": resumed,
        "steps": sorted(by_pid.values()) == sorted([STEPS, step, STEPS - step]),
        "rejoined": bool(rejoined) or f"[i{island}] [w0] tfdist: island {island} of 2: meeting"
                    in out.split("resuming from")[-1],
    }
    return {"island": island, "kill_after_step": step, "seconds": round(seconds, 1),
            "rejoined_at_round": int(rejoined.group(1)) if rejoined else None,
            "steps_by_process": sorted(by_pid.values()), "checks": checks,
            "passed": all(checks.values())}, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data_dir", default="", help="the token stores' directory (default: "
                                                   "the config's)")
    ap.add_argument("--out", default="bench_results/chaos-islands.json")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    between = [s for s in range(2, STEPS - 1) if s % SYNC_EVERY]  # (not at a sync)
    rows = []
    for k in range(args.trials):
        island, step = k % 2, rng.choice(between)
        with tempfile.TemporaryDirectory(prefix="tfdist-chaos-islands-") as workdir:
            row, out = trial(workdir, island, step, args.data_dir)
        rows.append(row)
        print(f"trial {k}: island {island} killed after step {step}: "
              f"{'passed' if row['passed'] else 'FAILED'} ({row['seconds']} s; rejoined at round "
              f"{row['rejoined_at_round']}); {row['checks']}", flush=True)
        if not row["passed"]:
            print(out[-4000:])
    passed = sum(r["passed"] for r in rows)
    print(f"\n{passed}/{len(rows)} trials passed")
    print(f"{'trial':>5} {'island':>6} {'kill':>5} {'rejoined':>9} {'seconds':>8} {'ok':>3}")
    for k, r in enumerate(rows):
        ok = "yes" if r["passed"] else "no"
        print(f"{k:5d} {r['island']:6d} {r['kill_after_step']:5d} "
              f"{str(r['rejoined_at_round']):>9} {r['seconds']:8.1f} {ok:>3}")
    with open(os.path.join(harness.ROOT, args.out), "w") as f:
        json.dump({"steps": STEPS, "sync_every": SYNC_EVERY, "islands": 2, "workers": 2,
                   "config": "gpt_nano", "seed": args.seed, "passed": passed, "trials": rows,
                   "host": host()}, f, indent=1)
    print(f"wrote {args.out}")
    sys.exit(0 if passed == len(rows) else 1)


if __name__ == "__main__":
    main()
