"""Benchmark: the GPipe pipeline, the GPT in K=2 stages on 2 logical CPU devices with M
microbatches, against the unsplit model on one device (`make bench-pipeline`).

    python tools/bench/pipeline.py [--microbatches=1,2,4,8,16]

Each process has 1 intra-op thread (so one compute thread per device); the pipelined runs 2
inter-op threads so that the stages' ops can run at once. Per M: step time, speedup over unsplit,
the GPipe ideal KM/(M+K-1), the fraction of it reached, and the measured bubble 1 - speedup/K;
plus each stage's estimated peak memory. Writes bench_results/pipeline.json.
"""
import os
import re
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import (  # noqa: E402
    ROUNDS,
    STEPS,
    WARMUP,
    cli,
    config,
    config_filename,
    train_run,
    write_json,
)

_MICROBATCHES = flags.DEFINE_list("microbatches", ["1", "2", "4", "8", "16"], "M values.")


def main(argv):
    del argv
    """K=2 stages on 2 logical CPU devices, M microbatches, vs the unsplit model."""
    import tempfile

    import numpy as np

    c = config()
    k = 2
    steps = WARMUP.value + STEPS.value
    ms = [int(m) for m in _MICROBATCHES.value]
    tmp = tempfile.mkdtemp(prefix="tfdist-pipeline-")
    # Pipelined: 1 intra-op thread, and 2 inter-op threads so that the two stages' ops can run
    # at once. Unsplit, on one device: the same threads (the reference); and with 1 inter-op
    # thread, i.e. strictly one core (2 inter-op threads let independent ops, such as a
    # matmul's two gradients, run at once even on one device).
    variants = {"unsplit": (2, []), "unsplit-1": (1, [])}
    for m in ms:
        variants[f"M={m}"] = (2, [f"--config.pipeline.stages={k}",
                                  f"--config.pipeline.microbatches={m}"])
    times = {name: [] for name in variants}
    memory = {}
    for r in range(ROUNDS.value):
        for name, (inter, extra) in variants.items():
            log = train_run(os.path.join(tmp, name.replace("=", "")), 1, steps, inter, extra)
            t = float(np.median([s["step_time"] for s in log[WARMUP.value:]]))
            times[name].append(t)
            print(f"round {r + 1}: {name:8s} {t:6.2f} s/step", flush=True)
            if extra:  # the run's own report: estimated and measured peak memory per stage
                memory[name] = re.findall(r"tfdist: (stage \d+ on .*)$", train_run.stdout, re.M)
    base = float(np.median(times["unsplit"]))
    one = float(np.median(times["unsplit-1"]))
    rows = [{"variant": "unsplit", "microbatches": None, "step_time_s": base, "speedup": 1.0},
            {"variant": "unsplit-1", "microbatches": None, "step_time_s": one,
             "speedup": base / one}]
    for m in ms:
        t = float(np.median(times[f"M={m}"]))
        speedup, ideal = base / t, k * m / (m + k - 1)
        rows.append({"variant": f"K={k}, M={m}", "microbatches": m, "step_time_s": t,
                     "speedup": speedup, "ideal_speedup": ideal, "of_ideal": speedup / ideal,
                     "ideal_bubble": (k - 1) / (m + k - 1), "measured_bubble": 1 - speedup / k,
                     "speedup_vs_1_inter_op_thread": one / t,
                     "per_round_s": times[f"M={m}"]})
    print(f"\n{os.path.basename(config_filename())}: batch {c.train.batch_size} x "
          f"{c.model.block_size}, K={k} stages on 2 logical CPU devices, 1 intra-op thread per "
          f"device; median of {ROUNDS.value} interleaved rounds")
    print(f"{'variant':12s} {'s/step':>7s} {'speedup':>8s} {'ideal':>6s} {'of ideal':>9s} "
          f"{'bubble':>7s} {'ideal bubble':>13s}")
    for r in rows:
        if r["microbatches"] is None:
            print(f"{r['variant']:12s} {r['step_time_s']:7.2f} {r['speedup']:8.2f}")
            continue
        print(f"{r['variant']:12s} {r['step_time_s']:7.2f} {r['speedup']:8.2f} "
              f"{r['ideal_speedup']:6.2f} {100 * r['of_ideal']:8.1f}% "
              f"{100 * r['measured_bubble']:6.1f}% "
              f"{100 * r['ideal_bubble']:12.1f}%")
    print("target at M=8: >= 85% of ideal. unsplit: 1 intra + 2 inter-op threads (the reference); "
          "unsplit-1: 1 intra + 1 inter-op thread")
    print("\npeak memory per stage, as each run reported it:")
    for name, lines in memory.items():
        print(f"  {name}: " + "; ".join(lines))
    write_json({"config": os.path.basename(config_filename()), "stages": k,
                "batch": c.train.batch_size, "context": c.model.block_size,
                "threads": "unsplit: 1 intra + 2 inter; unsplit-1: 1 intra + 1 inter; "
                           "pipelined: 1 intra + 2 inter",
                "rows": rows, "memory": memory}, "bench_results/pipeline.json")




if __name__ == "__main__":
    cli.run(main, sys.argv)
