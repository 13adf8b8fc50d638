"""Benchmark: the overlap of the gradient all-reduce with the backward pass
(tfdist/parallel/buckets.py; `make bench-overlap`).

    python tools/bench/overlap.py --rounds=2
    python tools/bench/overlap.py --link=10gbit --buckets=25 --rounds=1   # on shaped links (root)

The 2-process efficiency of multi_worker_mirrored and horovod with strategy.overlap=off and with
buckets of each --buckets size (MiB), against one process, all interleaved round by round (1
intra-op and --inter_op_threads inter-op thread per process, the same batch per process); with
--link on the test cluster's shaped links. The last round's runs profile their last step: each
strategy's trace (both processes, overlapped and not, Chrome trace format: chrome://tracing or
ui.perfetto.dev) goes to bench_results/overlap-trace-<strategy>.json, and its overlap report
(tfdist.runtime.profiling.overlap) to bench_results/overlap[-<link>].json, beside the planner's
prediction for each row.
"""
import json
import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.common import (  # noqa: E402
    INTER,
    LINK,
    ROUNDS,
    STEPS,
    WARMUP,
    WORKERS,
    cli,
    config,
    config_filename,
    link_suffix,
    params,
    train_run,
    write_json,
)

_BUCKETS = flags.DEFINE_list("buckets", ["1", "4", "25", "100"], "Bucket sizes (MiB).")


def main(argv):
    """Overlapped against not, and the bucket sizes, for both synchronous strategies."""
    del argv
    import tempfile

    import numpy as np

    from tfdist.plan.model import allreduce_seconds, exposed_allreduce
    from tfdist.runtime import profiling

    n = WORKERS.value
    steps = WARMUP.value + STEPS.value
    c = config()
    tokens_1 = c.train.batch_size * c.model.block_size
    variants = {"1 process": (1, False, [])}
    for strategy, horovod in (("multi_worker_mirrored", False), ("horovod", True)):
        variants[f"{strategy} off"] = (n, horovod, ["--config.strategy.overlap=off"])
        for size in _BUCKETS.value:
            variants[f"{strategy} {float(size):g} MiB"] = (
                n, horovod, [f"--config.strategy.bucket_mb={float(size)}"])
    tmp = tempfile.mkdtemp(prefix="tfdist-overlap-")
    rates = {name: [] for name in variants}
    n_params = None
    for r in range(ROUNDS.value):
        last = r == ROUNDS.value - 1
        for name, (workers, horovod, extra) in variants.items():
            workdir = os.path.join(tmp, name.replace(" ", "_"))
            profile = [f"--config.train.profile_step={steps}"] if last and workers > 1 else []
            log = train_run(workdir, workers, steps, extra=[*extra, *profile], horovod=horovod)
            n_params = n_params or params(train_run.stdout)
            rates[name].append(float(np.median([x["tokens_per_sec"] for x in log[WARMUP.value:]])))
            eff = rates[name][-1] / (workers * rates["1 process"][-1])
            print(f"round {r + 1}: {name:32s} {rates[name][-1]:8.0f} tokens/s, efficiency "
                  f"{100 * eff:5.1f}%", flush=True)
    # the planner: T1 against T1 plus the all-reduce it leaves exposed (tfdist.plan.model), at
    # the link's rate, or on loopback at the bus bandwidth `make bench-allreduce` measured
    from tfdist.plan.machine import allreduce_bandwidth
    from tools.cluster.netcluster import _bits
    t1 = tokens_1 / float(np.median(rates["1 process"]))
    rows = []
    for name, (workers, horovod, _) in variants.items():
        per_round = [x / (workers * y) for x, y in zip(rates[name], rates["1 process"])]
        row = {"variant": name, "tokens_per_sec": float(np.median(rates[name])),
               "efficiency": float(np.median(per_round)), "per_round": per_round}
        if workers > 1:
            row["strategy"] = "horovod" if horovod else "multi_worker_mirrored"
            row["overlap"] = "off" if name.endswith("off") else "on"
            row["bucket_mb"] = None if row["overlap"] == "off" else float(name.split()[-2])
            bw = (_bits(LINK.value) / 8 if LINK.value else
                  allreduce_bandwidth("bench_results",
                                      "horovod/gloo" if horovod else "tf ring (MWMS)"))
            if bw and n_params:
                comm = allreduce_seconds(4 * n_params, workers, bw)
                if row["overlap"] == "on":  # the backward pass: 2 of a step's 3 matmul passes
                    comm = exposed_allreduce(comm, t1 * 2 / 3, 4 * n_params,
                                             row["bucket_mb"] * 2 ** 20)
                row["planner_predicted_efficiency"] = t1 / (t1 + comm)
                row["planner_error"] = row["planner_predicted_efficiency"] / row["efficiency"] - 1
        rows.append(row)
    traces = {}
    sizes = [float(x) for x in _BUCKETS.value]
    on = f"{25.0 if 25.0 in sizes else sizes[0]:g} MiB"  # the default bucket size, if measured
    for strategy in ("multi_worker_mirrored", "horovod"):
        per_worker, reports = {}, {}
        for label in (on, "off"):
            name = f"{strategy} {label}"
            if name not in variants:
                continue
            workdir = os.path.join(tmp, name.replace(" ", "_"))
            for w in range(n):
                events = profiling.read(os.path.join(workdir, "profile", f"worker-{w}"))
                per_worker[len(per_worker)] = events
                report = profiling.overlap(events)
                report.pop("all_reduces")
                reports[f"{label}, worker {w}"] = report
        if per_worker:
            out = f"bench_results/overlap-trace-{strategy}{link_suffix()}.json"
            with open(out, "w") as f:
                json.dump(profiling.chrome_trace(per_worker), f)
            traces[strategy] = {"file": out, "processes": f"overlapped ({on}) workers first, "
                                f"then overlap=off", "reports": reports}
    print(f"\n{os.path.basename(config_filename())}: batch {c.train.batch_size} x "
          f"{c.model.block_size} per process, {n} processes, 1 intra-op and {INTER.value} inter-op "
          f"thread(s) each, {LINK.value or 'loopback'}; median of {ROUNDS.value} interleaved "
          f"rounds")
    print(f"{'variant':34s} {'tokens/s':>9s} {'efficiency':>11s} {'planner':>8s}")
    for row in rows:
        pred = row.get("planner_predicted_efficiency")
        print(f"{row['variant']:34s} {row['tokens_per_sec']:9.0f} {100 * row['efficiency']:10.1f}% "
              + (f"{100 * pred:7.1f}%" if pred else ""))
    for strategy, t in traces.items():
        for key, rep in t["reports"].items():
            print(f"trace {strategy} {key}: {rep['issued_during_backward']} all-reduce(s) issued "
                  f"and {rep['completed_during_backward']} completed before the backward pass "
                  f"ended; {100 * rep['hidden_fraction']:.0f}% of "
                  f"{rep['communication_us'] / 1e3:.0f} ms of communication hidden, "
                  f"{rep['exposed_communication_us'] / 1e3:.0f} ms exposed")
    write_json({"config": os.path.basename(config_filename()), "workers": n,
                "batch_per_process": c.train.batch_size, "context": c.model.block_size,
                "intra_op_threads": 1, "inter_op_threads": INTER.value,
                "timed_steps_per_run": STEPS.value, "link": LINK.value or "loopback",
                "rows": rows, "traces": traces}, f"bench_results/overlap{link_suffix()}.json")




if __name__ == "__main__":
    cli.run(main, sys.argv)
