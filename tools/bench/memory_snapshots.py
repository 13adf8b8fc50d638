"""What the snapshots in memory cost training (tfdist/callbacks/memory.py): 2 workers under
`tfdist launch` with a snapshot every step, every 10, and none, interleaved.

    python tools/bench/memory_snapshots.py                  # gpt_mini, MWMS, 2 rounds
    python tools/bench/memory_snapshots.py --config=gpt_nano --steps=60

Each run: `tfdist launch --workers=2` of `tfdist train` (--steps steps, no disk backup, so that
only the snapshots differ), `backup.memory_every_steps` 1, 10 or 0 (and `peer_every_steps`
alike). The step time is the median of the logged steps after the first 3; the overhead is that
over the run without snapshots, minus 1, within a round. Also the median send time of a snapshot
as the run says it. Prints a table and writes bench_results/memory-snapshots.json.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tools.bench.common import host  # noqa: E402
from tools.faults.chaos_partition import prepare_data  # noqa: E402
from tools.faults.harness import metrics  # noqa: E402

EVERY = (1, 10, 0)


def run(work, data_dir, config, steps, every, batch):
    p = subprocess.run([sys.executable, "-m", "tfdist", "launch", "--workers=2",
                        "--max_restarts=0", "--", f"--config=configs/{config}.py",
                        f"--workdir={work}", f"--config.data.data_dir={data_dir}",
                        f"--config.train.steps={steps}", f"--config.train.steps_per_epoch={steps}",
                        f"--config.train.batch_size={batch}", "--config.train.eval_steps=1",
                        "--config.train.warmup_steps=1", "--config.backup.enabled=true",
                        "--config.backup.every_steps=0",
                        f"--config.backup.memory_every_steps={every}",
                        f"--config.backup.peer_every_steps={every or 1}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if p.returncode:
        sys.exit(f"the run failed: {p.stdout[-3000:]}{p.stderr[-2000:]}")
    times = [r["step_time"] for r in metrics(work)["steps"][3:]]
    sent = re.search(r"memory snapshots: (\d+) sent .*?, (\d+) ms each", p.stdout)
    return statistics.median(times), (int(sent.group(2)) if sent else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="gpt_mini")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tfdist-memory-")
    data_dir = prepare_data(os.path.join(tmp, "data"))
    rows = []
    for k in range(args.rounds):
        for every in EVERY:
            step, send_ms = run(os.path.join(tmp, f"r{k}-{every}"), data_dir, args.config,
                                args.steps, every, args.batch)
            rows.append({"round": k, "memory_every_steps": every, "step_s": round(step, 4),
                         "send_ms": send_ms})
            print(json.dumps(rows[-1]), flush=True)
    overhead = {every: [round(a["step_s"] / b["step_s"] - 1, 4) for a, b in zip(
        [r for r in rows if r["memory_every_steps"] == every],
        [r for r in rows if r["memory_every_steps"] == 0])] for every in EVERY[:-1]}
    print(f"\n{args.config}, 2 MWMS workers, global batch {args.batch}\n")
    print("| round | snapshot every | step | send |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['memory_every_steps'] or 'never'} | {r['step_s']:.3f} s | "
              f"{r['send_ms'] if r['send_ms'] is not None else '-'} ms |")
    said = [f"every {e}: {', '.join(f'{x:+.1%}' for x in v)}" for e, v in overhead.items()]
    print("\noverhead over none, per round: " + "; ".join(said))
    out = os.path.join(ROOT, "bench_results", "memory-snapshots.json")
    with open(out, "w") as f:
        json.dump({"config": f"configs/{args.config}.py", "workers": 2, "batch": args.batch,
                   "steps": args.steps, "rows": rows, "overhead": overhead, "host": host()},
                  f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
