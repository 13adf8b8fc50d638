"""This machine: the CPU as `make bench*` measured it (bench_results/*.json, committed), and
the benches' figures predicted from their inputs (`tfdist plan --measured`).
"""
import dataclasses
import json
import math
import os

from tfdist.errors import UsageError
from tfdist.plan.model import GB, Cluster, Device, Options, planned, step_time
from tfdist.plan.published import CPU, fit_efficiency

BENCH_HINT = {"bench.json": "make bench", "scaling.json": "make bench-scaling",
              "scaling-horovod.json": "make bench-scaling-horovod", "allreduce.json": "make bench-allreduce",
              "pipeline.json": "make bench-pipeline"}


def read_bench(bench_dir, name):
    """A bench result, or None when it has not been run here (a target not run yet)."""
    path = os.path.join(bench_dir, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path} ({e}); re-run `{BENCH_HINT.get(name, 'the bench')}`") from None


def allreduce_bandwidth(bench_dir, implementation="tf ring (MWMS)"):
    """Bus bandwidth (bytes/s) at the largest buffer `make bench-allreduce` measured, or None."""
    ar = read_bench(bench_dir, "allreduce.json")
    if not ar or not ar.get("rows") or implementation not in ar["rows"][-1]:
        return None
    return ar["rows"][-1][implementation]["busbw_GBps"] * GB


def cpu_device(bench_dir):
    """One core of this machine: its share of the matmul peak that `make bench` measured, its
    share of the RAM, and the all-reduce bandwidth `make bench-allreduce` measured between two
    processes (over loopback, so 'inside a node')."""
    bench = read_bench(bench_dir, "bench.json")
    if not bench:
        raise UsageError(f"this CPU has not been measured: no {os.path.join(bench_dir, 'bench.json')}; "
                         f"run `make bench` first (or pick another --device)")
    cores = bench.get("cores") or os.cpu_count()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bw = allreduce_bandwidth(bench_dir) or 0.3 * GB  # 0.29-0.35 GB/s measured on this machine
    return Device(CPU, bench["matmul_peak_flops"] / cores, ram / cores, None, bw, bw, cores,
                  f"{bench_dir}/bench.json (fp32 2048^3 matmul peak / {cores} cores) and allreduce.json")


def _fit_to_one_process(dev, model, bench, opts):
    """The fraction of peak that reproduces a scaling bench's 1-process step time, and that time."""
    per = bench["batch_per_worker"]
    t1 = per * model.seq_len / bench["tokens_per_sec_1"]
    return fit_efficiency(model, Cluster(dev, 1), planned(per, 1, microbatch=per), t1, opts), t1


def measured(bench_dir, model):
    """Predicted against measured on this machine. The fraction of peak is fitted to the
    1-process step time of `make bench-scaling` (gpt_mini, 1 thread per process); then the 2-process
    data-parallel efficiency (collective ring and Horovod) and the 2-stage pipeline speedups are
    predicted with the all-reduce bandwidth `make bench-allreduce` measured. Rows whose bench
    has not been run say which make target to run."""
    dev = cpu_device(bench_dir)
    opts = Options(precision="float32", schedule="gpipe")
    rows = []
    for name, impl, label in (("scaling.json", "tf ring (MWMS)", "2-worker efficiency, multi_worker_mirrored"),
                              ("scaling-horovod.json", "horovod/gloo", "2-rank efficiency, horovod")):
        s = read_bench(bench_dir, name)
        if not s:
            rows.append({"figure": label, "missing": BENCH_HINT[name]})
            continue
        bw = allreduce_bandwidth(bench_dir, impl)
        if bw is None:
            rows.append({"figure": label, "missing": BENCH_HINT["allreduce.json"]})
            continue
        f, t1 = _fit_to_one_process(dev, model, s, opts)
        o = dataclasses.replace(opts, efficiency=f, overlap=s.get("overlap") == "on",
                                bucket_bytes=s.get("bucket_mb", 25.0) * 2 ** 20)
        per = s["batch_per_worker"]
        t2 = step_time(model, Cluster(dev, 2, intra_bw=bw, inter_bw=bw),
                       planned(2 * per, 2, microbatch=per), o)["total"]
        rows.append({"figure": label, "predicted": t1 / t2, "measured": s["scaling_efficiency"],
                     "note": f"fitted {f:.1%} of the per-core peak; all-reduce at {bw / GB:.2f} GB/s"})
    p = read_bench(bench_dir, "pipeline.json")
    if not p:
        rows.append({"figure": "2-stage pipeline speedup", "missing": BENCH_HINT["pipeline.json"]})
    else:
        batch = p["batch"]
        base = {r["variant"]: r["step_time_s"] for r in p["rows"]}
        one = base.get("unsplit-1")  # the unsplit model on one core: one device's compute
        if one is None:
            return rows + [{"figure": "2-stage pipeline speedup", "missing": BENCH_HINT["pipeline.json"]}]
        f = fit_efficiency(model, Cluster(dev, 1), planned(batch, 1, microbatch=batch), one, opts)
        o = dataclasses.replace(opts, efficiency=f)
        for r in p["rows"]:
            if not r.get("microbatches"):
                continue
            m, k = r["microbatches"], p["stages"]
            # the stages are in one process: activations pass between them by reference
            inproc = Cluster(dev, k, intra_bw=math.inf, inter_bw=math.inf)
            t = step_time(model, inproc, planned(batch, 1, pp=k, microbatch=batch // m), o)["total"]
            rows.append({"figure": f"pipeline K={k}, M={m}: speedup vs one core", "predicted": one / t,
                         "measured": r["speedup_vs_1_inter_op_thread"],
                         "note": f"vs unsplit with the same threads: measured {r['speedup']:.2f}"})
    return rows
