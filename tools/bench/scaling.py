"""Benchmark: the scaling of data-parallel training over processes (`make bench-scaling`,
`bench-scaling-horovod`, `bench-scaling-ps`, `bench-links`).

    python tools/bench/scaling.py              # 2 workers x 1 thread vs 1 x 1 thread, gpt_mini
    python tools/bench/scaling.py --ps         # parameter server: 2 workers + 1 ps vs 1 + 1
    python tools/bench/scaling.py --horovod [--compression=fp16]      # Horovod ranks
    python tools/bench/scaling.py --link=1gbit [--straggler=100mbit]  # on shaped links (root)

It runs real `tfdist train` processes. A single-process run (1 intra-op thread, --inter_op_threads
inter-op threads) and a `tfdist launch --workers=2` run (multi_worker_mirrored, or Horovod: the
same threads per process, the same batch per process, so twice the global batch) alternate for
--rounds rounds. Each run's steady tokens/s is the median over its steps after --warmup; scaling
efficiency = tokens/s(2 processes) / (2 * tokens/s(1 process)), per round and as the median of
the rounds. Writes bench_results/scaling[-horovod[-fp16]][-<link>].json. With --ps:
`tfdist launch --strategy=parameter_server` with 1 ps task and 1 or 2 workers (each step one batch
on one worker), in steps/s from the run's progress reports after the first; writes
bench_results/scaling-ps[-<link>].json.
"""
import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import (  # noqa: E402
    COMPRESSION,
    HOROVOD,
    INTER,
    LINK,
    OUT,
    ROUNDS,
    STEPS,
    STRAGGLER,
    WARMUP,
    WORKERS,
    cli,
    config,
    config_filename,
    link_suffix,
    matmul_peak,
    ps_run,
    train_run,
    write_json,
)

_PS = flags.DEFINE_bool("ps", False, "The parameter server instead: 2 workers + 1 ps vs 1 worker "
                        "+ 1 ps, in steps/s.")


def predicted(result, out):
    """The planner's efficiency for this run: `tfdist plan --measured`'s row for it
    (tfdist.plan.benchmarks.scaling_row: the one-process step of this run, two processes on the
    cores as the host model has them, the collective's copies as allreduce[-<link>].json measured
    them, and the link's wire time), read once `out` is written (a loopback run is its own
    reference)."""
    from tfdist.plan import benchmarks, load_config, machine, model_from_config
    name = os.path.basename(config_filename())
    model = model_from_config(load_config(config_filename()), name.removesuffix(".py"))
    h = machine.host(os.path.dirname(out), model)
    row = benchmarks.scaling_row(h, model, os.path.dirname(out), os.path.basename(out), result)
    return row.get("predicted"), row.get("note")


def ps_scaling():
    import tempfile

    import numpy as np

    steps = 10 * max(2, STEPS.value // 2 + 1)  # reports come every 10 steps; the first is warm-up
    c = config()
    tmp = tempfile.mkdtemp(prefix="tfdist-scaling-ps-")
    rounds = []
    for r in range(ROUNDS.value):
        row = {}
        for workers in (1, 2):
            row[workers] = ps_run(os.path.join(tmp, f"w{workers}"), workers, steps)
            print(f"round {r + 1}: {workers} worker(s) + 1 ps: {row[workers]:.3f} steps/s",
                  flush=True)
        rounds.append({"steps_per_sec_1": row[1], "steps_per_sec_2": row[2],
                       "efficiency": row[2] / (2 * row[1]), "worker_steps_2": ps_run.worker_steps})
    eff = float(np.median([x["efficiency"] for x in rounds]))
    s1 = float(np.median([x["steps_per_sec_1"] for x in rounds]))
    s2 = float(np.median([x["steps_per_sec_2"] for x in rounds]))
    result = {"config": os.path.basename(config_filename()), "batch_per_step": c.train.batch_size,
              "context": c.model.block_size, "ps_tasks": 1, "intra_op_threads": 1,
              "inter_op_threads": INTER.value or "TF default", "steps_per_run": steps,
              "rounds": rounds, "steps_per_sec_1": s1, "steps_per_sec_2": s2,
              "scaling_efficiency": eff, "link": LINK.value or "loopback",
              "straggler": LINK.value and STRAGGLER.value}
    print(f"\n{result['config']}: batch {c.train.batch_size} x {c.model.block_size} per step, "
          f"parameter_server with 1 ps, median of {ROUNDS.value} interleaved rounds")
    print(f"1 worker + 1 ps: {s1:.3f} steps/s; 2 workers + 1 ps: {s2:.3f} steps/s")
    print(f"scaling efficiency: {100 * eff:.1f}% (target >= 80%)")
    write_json(result, f"bench_results/scaling-ps{link_suffix()}.json")


def scaling():
    import tempfile

    import numpy as np

    n = WORKERS.value
    steps = WARMUP.value + STEPS.value
    c = config()
    tokens_1 = c.train.batch_size * c.model.block_size
    tmp = tempfile.mkdtemp(prefix="tfdist-scaling-")
    peak = matmul_peak()  # (the planner fits the one-process step against this day's peak)
    rounds = []
    for r in range(ROUNDS.value):
        row = {}
        for workers in (1, n):  # interleaved: the machine's noise hits both alike
            log = train_run(os.path.join(tmp, f"w{workers}"), workers, steps)
            rates = [s["tokens_per_sec"] for s in log[WARMUP.value:]]
            row[workers] = float(np.median(rates))
            print(f"round {r + 1}: {workers} worker(s) x 1 thread: {row[workers]:8.0f} tokens/s "
                  f"({workers * tokens_1 / row[workers]:.2f} s/step)", flush=True)
        rounds.append({"tokens_per_sec_1": row[1], f"tokens_per_sec_{n}": row[n],
                       "efficiency": row[n] / (n * row[1])})
    eff = float(np.median([x["efficiency"] for x in rounds]))
    tps1 = float(np.median([x["tokens_per_sec_1"] for x in rounds]))
    tpsn = float(np.median([x[f"tokens_per_sec_{n}"] for x in rounds]))
    strategy = (f"horovod, compression {COMPRESSION.value}" if HOROVOD.value
                else "multi_worker_mirrored")
    result = {"config": os.path.basename(config_filename()), "batch_per_worker": c.train.batch_size,
              "strategy": strategy,
              "context": c.model.block_size, "workers": n, "intra_op_threads": 1,
              "inter_op_threads": INTER.value or "TF default",
              "timed_steps_per_run": STEPS.value, "rounds": rounds,
              "tokens_per_sec_1": tps1, f"tokens_per_sec_{n}": tpsn, "scaling_efficiency": eff,
              "link": LINK.value or "loopback", "straggler": LINK.value and STRAGGLER.value,
              "matmul_peak_flops": peak}
    out = OUT.value or (f"bench_results/scaling{link_suffix()}.json" if not HOROVOD.value else
                        f"bench_results/scaling-horovod"
                        f"{'-fp16' if COMPRESSION.value == 'fp16' else ''}{link_suffix()}.json")
    write_json(result, out)
    prediction, note = predicted(result, out)
    if prediction is not None:
        result["planner_predicted_efficiency"] = prediction
        result["planner_error"] = prediction / eff - 1
        result["planner_note"] = note
    print(f"\n{result['config']}: batch {c.train.batch_size} x {c.model.block_size} per worker, "
          f"1 intra-op and {INTER.value or 'default'} inter-op thread(s) per worker, median of "
          f"{ROUNDS.value} interleaved rounds")
    print(f"{'run':34s} {'tokens/s':>10s} {'s/step':>8s}")
    print(f"{'1 process (single)':34s} {tps1:10.0f} {tokens_1 / tps1:8.2f}")
    print(f"{f'{n} workers ({strategy})':34s} {tpsn:10.0f} {n * tokens_1 / tpsn:8.2f}")
    print(f"scaling efficiency: {100 * eff:.1f}% (target >= 90%)"
          + (f"; the planner predicts {100 * prediction:.1f}% "
             f"({100 * result['planner_error']:+.1f}%: {note})" if prediction is not None else ""))
    write_json(result, out)



def main(argv):
    del argv
    return ps_scaling() if _PS.value else scaling()


if __name__ == "__main__":
    cli.run(main, sys.argv)
