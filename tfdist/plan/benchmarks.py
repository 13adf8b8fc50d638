"""Every committed benchmark's figures predicted from that benchmark's own inputs, beside the
measured ones (`tfdist plan --measured`, `make plan-measured`): the host model of this machine is
in tfdist.plan.machine; here each bench's rows, judged within ±10 % or given their reason.
"""
import dataclasses
import glob
import math
import os

from tfdist.plan.machine import (
    BENCH_HINT,
    FP32,
    RING,
    allreduce_time,
    collective,
    host,
    link_rate,
    one_core,
    read_bench,
)
from tfdist.plan.model import GB, Cluster, memory, planned, step_time
from tfdist.plan.published import fit_efficiency

TOLERANCE = 0.10  # a prediction within ±10 % of the measured figure
_PS_LINK = ("the ps task's own link carries both workers' pulls and pushes, which the model "
            "gives each worker a link of its own for (not modelled; slow links only)")
KNOWN = {"scaling-ps-100mbit.json": _PS_LINK, "scaling-ps-1gbit-straggler100mbit.json": _PS_LINK}
ABOVE_100 = ("above 100 %, not real: each process ran faster than the one-process reference for "
             "the same work (docs/benchmarks.md: unusable, cause not found; all on loaded days, "
             "where a process with more runnable threads than the reference's one would take more "
             "of the shared cores: not checked)")


def judged(row, reason=None):
    """`row` with its error and whether it is within TOLERANCE; if it is not, the reason."""
    row["error"] = row["predicted"] / row["measured"] - 1
    row["within"] = abs(row["error"]) <= TOLERANCE
    if not row["within"]:
        row["reason"] = reason
    return row


def why_off(name, measured, predicted, rounds=(), load=0.0):
    """Why a scaling row is off: a run docs/benchmarks.md calls unusable, an efficiency above 100 %,
    rounds that spread wider than the error, or one round on a loaded day; else None."""
    near = [x for x in rounds if abs(predicted / x - 1) <= TOLERANCE]
    if name in KNOWN:
        return KNOWN[name]
    if measured > 1:
        return ABOVE_100
    if near:
        return (f"noise: its rounds measured {', '.join(f'{x:.3f}' for x in rounds)}, and "
                f"{near[0]:.3f} is within 10 %")
    if load and len(rounds) <= 1:
        return ("one round on a loaded day: the load moved during the run (the 1-worker "
                "references of that day's parameter-server runs differ by 27 %, "
                "docs/benchmarks.md)")
    return None


# ---------------------------------------------------------------------------------------------
# Two processes against one: data parallel (scaling*.json, overlap.json) and the parameter server.


def two_processes(h, model, per, t1, allreduce, wire, same_day, opts=FP32):
    """(step of 2 data-parallel processes, other threads on the cores) for a one-process step of
    `t1` s over `per` sequences, the gradients' all-reduce taking `allreduce` s, `wire` s of it on a
    link. Its cores' part was measured unloaded unless `same_day` (allreduce-<link>.json, run with
    the link runs): on a loaded day it gets the share of a core each process gets."""
    f1 = one_core(h.dev, model, per, t1)
    load = h.load(f1)
    cores = allreduce - wire if same_day else (allreduce - wire) / h.share(2, load)
    grads = model.params * 4  # float32 gradients; a ring of 2 moves them once each way
    bw = grads / (cores + wire)
    o = dataclasses.replace(opts, efficiency=f1 / h.share(1, load),
                            core_share=h.share(2, load) / h.contention,
                            comm_cpu_bw=grads / cores if cores > 0 else math.inf)
    t2 = step_time(model, Cluster(h.dev, 2, intra_bw=bw, inter_bw=bw),
                   planned(2 * per, 2, microbatch=per), o)["total"]
    return t2, load


def _collective(bench_dir, s, impl, grads):
    """A run's link, the allreduce*.json measured on it, and there the seconds of an all-reduce of
    `grads` bytes by `impl` (None if not measured)."""
    link = s.get("link") or "loopback"
    ar_name = "allreduce.json" if link == "loopback" else f"allreduce-{link}.json"
    return link, ar_name, allreduce_time(read_bench(bench_dir, ar_name), impl, grads)


def _day(h, load):
    return ((f"loaded: {load:.1f} other threads, 2 processes get {h.share(2, load):.2f} of a core "
             f"each (1 got {h.share(1, load):.2f})" if load else "unloaded")
            + f"; contention {h.contention:.3f}")


def scaling_row(h, model, bench_dir, name, s):
    """A scaling*.json (not the parameter server's): 2 processes' efficiency against one."""
    impl = collective(s.get("strategy", "multi_worker_mirrored"))
    grads = model.params * 4
    link, ar_name, allreduce = _collective(bench_dir, s, impl, grads)
    figure = f"{name}: {'MWMS' if impl == RING else impl.replace('/gloo', '')}, 2 processes vs 1"
    if allreduce is None:
        return {"figure": figure, "missing": BENCH_HINT.get(ar_name, "make bench-links")}
    sent = grads / 2 if "fp16" in impl else grads  # what the wire carries each way
    wire = 0.0 if link == "loopback" else sent / link_rate(link)
    if s.get("straggler"):  # the ring goes at its slowest link's pace
        straggler_wire = sent / link_rate(s["straggler"])
        allreduce = allreduce - wire + straggler_wire
        wire = straggler_wire
    per = s["batch_per_worker"]
    t1 = per * model.seq_len / s["tokens_per_sec_1"]
    opts = dataclasses.replace(FP32, overlap=s.get("overlap") == "on",
                               bucket_bytes=s.get("bucket_mb", 25.0) * 2 ** 20)
    t2, load = two_processes(h, model, per, t1, allreduce, wire, link != "loopback", opts)
    measured, predicted = s["scaling_efficiency"], t1 / t2
    rounds = [r["efficiency"] for r in s.get("rounds", [])]
    return judged({"figure": figure, "measured": measured, "predicted": predicted,
                   "note": f"{link}: 1 process {t1:.2f} s, all-reduce {allreduce:.3f} s ({ar_name}"
                           f"{f'; {wire:.3f} s on the wire' if wire else ''}); {_day(h, load)}"},
                  why_off(name, measured, predicted, rounds, load))


def overlap_rows(h, model, bench_dir, o):
    """overlap.json: 2 processes against one, overlapped in buckets or not, on loopback. There the
    whole all-reduce is the cores' work, so overlap hides none of it."""
    ar = read_bench(bench_dir, "allreduce.json")
    per = o["batch_per_process"]
    t1 = per * model.seq_len / o["rows"][0]["tokens_per_sec"]  # the "1 process" row
    out = []
    for r in o["rows"][1:]:
        impl = collective(r["strategy"])
        allreduce = allreduce_time(ar, impl, model.params * 4)
        if allreduce is None:
            return out + [{"figure": "overlap.json", "missing": BENCH_HINT["allreduce.json"]}]
        opts = dataclasses.replace(FP32, overlap=r["overlap"] == "on",
                                   bucket_bytes=(r["bucket_mb"] or 25) * 2 ** 20)
        t2, load = two_processes(h, model, per, t1, allreduce, 0.0, False, opts)
        out.append(judged({"figure": f"overlap.json: {r['variant']}, 2 processes vs 1",
                           "measured": r["efficiency"], "predicted": t1 / t2,
                           "note": f"1 process {t1:.2f} s; {_day(h, load)}"},
                          why_off("overlap.json", r["efficiency"], t1 / t2,
                                  r.get("per_round", ()), load)))
    return out


def ps_row(h, model, bench_dir, name, p):
    """A scaling-ps*.json: steps/s of 2 asynchronous workers and 1 ps task against 1 worker. Each
    worker's step pulls the weights and pushes the gradients over gRPC, the bytes a ring
    all-reduce of 2 moves each way, one after the other on its link; with 2 workers computing,
    the other worker's transfer takes its copies from the cores too."""
    grads = model.params * 4
    link, ar_name, allreduce = _collective(bench_dir, p, RING, grads)
    figure = f"{name}: 2 workers vs 1, steps/s"
    if allreduce is None:
        return {"figure": figure, "missing": BENCH_HINT.get(ar_name, "make bench-links")}
    rates = [link_rate(link)] * 2 if link != "loopback" else [math.inf] * 2
    if p.get("straggler"):
        rates[1] = link_rate(p["straggler"])
    cores = allreduce - grads / rates[0]  # the copies' part; the rest of it was the wire's
    per = p["batch_per_step"]
    t1 = 1 / p["steps_per_sec_1"]
    f1 = one_core(h.dev, model, per, t1 - cores - 2 * grads / rates[0])
    load = h.load(f1)
    o = dataclasses.replace(FP32, efficiency=f1 / h.share(1, load),
                            core_share=h.share(2, load) / h.contention)
    compute = step_time(model, Cluster(h.dev, 1), planned(per, 1, microbatch=per), o)["total"]
    steps = [1 / (compute + 2 * cores + 2 * grads / rate) for rate in rates]
    measured, predicted = p["scaling_efficiency"], sum(steps) / (2 * p["steps_per_sec_1"])
    split = (f"; steps split {steps[0] / sum(steps):.0%} / {steps[1] / sum(steps):.0%} (measured "
             f"{' / '.join(map(str, p['rounds'][0].get('worker_steps_2') or ()))})"
             if p.get("straggler") else "")
    rounds = [r["efficiency"] for r in p.get("rounds", [])]
    return judged({"figure": figure, "measured": measured, "predicted": predicted,
                   "note": f"{link}: 1 worker {t1:.2f} s/step, transfers' copies {cores:.3f} s; "
                           f"{_day(h, load)}{split}"},
                  why_off(name, measured, predicted, rounds, load))


# ---------------------------------------------------------------------------------------------
# One process: the pipeline and tensor parallelism on its cores, ZeRO, memory, the framework.


def pipeline_rows(h, model, p):
    """pipeline.json: K stages in one process whose 2 inter-op threads run any ready op on the
    cores. The step takes the longer of the GPipe schedule's path, (M + K - 1) slots of a stage's
    microbatch, each at the speed the unsplit model reaches with the same threads (a stage alone
    runs its independent ops at once: the bench's `unsplit` row), and the work of the whole step
    shared by the cores, each computing `contention` times slower beside the other."""
    batch, k = p["batch"], p["stages"]
    base = {r["variant"]: r["step_time_s"] for r in p["rows"]}
    one = base.get("unsplit-1")  # the unsplit model on one core: one device's compute
    if one is None:
        return [{"figure": "pipeline.json", "missing": BENCH_HINT["pipeline.json"]}]
    o = dataclasses.replace(FP32, efficiency=one_core(h.dev, model, batch, one))
    work = (step_time(model, Cluster(h.dev, 1), planned(batch, 1, microbatch=batch),
                      dataclasses.replace(o, core_share=1 / h.contention))["total"]
            / min(k, h.dev.per_node))
    inproc = Cluster(h.dev, k, intra_bw=math.inf, inter_bw=math.inf)  # activations by reference
    rows = []
    for r in p["rows"]:
        if not r.get("microbatches"):
            continue
        m = r["microbatches"]
        path = step_time(model, inproc, planned(batch, 1, pp=k, microbatch=batch // m),
                         dataclasses.replace(o, core_share=one / base.get("unsplit", one)))["total"]
        measured = r["speedup_vs_1_inter_op_thread"]
        reason = (f"faster than {k} cores' worth of the one-core step ({measured:.2f}x): "
                  f"microbatches of {batch // m} run faster per token than the batch of {batch}; "
                  f"not modelled") if measured > k else None
        rows.append(judged({"figure": f"pipeline.json: K={k}, M={m} speedup vs one core",
                            "measured": measured, "predicted": one / max(path, work),
                            "note": f"bound by the {'schedule' if path > work else 'cores'}; "
                                    f"vs the unsplit model with the same threads: measured "
                                    f"{r['speedup']:.2f}"}, reason))
    return rows


def tensor_row(h, t):
    """tensor.json: t = 2 on two threads of one process against one core; `contention` is fitted
    on it, so it is not a prediction."""
    med = t["median_step_s"]
    speedup = med["unsplit (1 thread)"] / med["t=2"]
    return {"figure": "tensor.json: t=2 speedup vs one core", "measured": speedup,
            "predicted": speedup, "error": 0.0, "within": True, "fitted": True,
            "note": f"contention {h.contention:.3f} fitted here"}


def zero_rows(h, model, bench_dir, name, z):
    """zero*.json: ZeRO-1/2's step against plain data parallel's, 2 processes on loopback (ZeRO-3's
    rows are left out: the planner does not model its second gather and recompute yet). ZeRO's
    reduce-scatter and all-gather move the all-reduce's bytes (the cores' work either way, not
    hidden), and the update's memory traffic is inside the fitted fraction of peak on this CPU."""
    impl = collective(z["strategy"])
    plain = z["rows"][0]
    per = z["batch_per_rank"]
    allreduce = allreduce_time(read_bench(bench_dir, "allreduce.json"), impl,
                               plain["gradient_bytes"])
    if allreduce is None:
        return [{"figure": name, "missing": BENCH_HINT["allreduce.json"]}]
    bw = plain["gradient_bytes"] / allreduce
    cluster = Cluster(h.dev, 2, intra_bw=bw, inter_bw=bw)
    lay = planned(2 * per, 2, microbatch=per)
    o = dataclasses.replace(FP32, overlap=True, comm_cpu_bw=bw, core_share=1 / h.contention)
    o = dataclasses.replace(o, efficiency=fit_efficiency(model, cluster, lay, plain["step_s"], o))
    saturated = (f"the fit saturates: plain's step ({plain['step_s']:.3f} s) is faster than the "
                 f"model's compute at 100 % of bench.json's matmul peak plus its all-reduce at "
                 f"allreduce.json's rate (this run was on a faster day than those; make bench "
                 f"and make bench-allreduce remeasure them)") if o.efficiency > 0.999 else None
    rows = []
    for r in z["rows"][1:]:
        if r["stage"] == 3:  # its regather and recompute are not modelled yet (issue 34)
            continue
        t = step_time(model, cluster, dataclasses.replace(lay, zero=r["stage"]), o)["total"]
        rows.append(judged({"figure": f"{name}: {r['variant']} step vs plain, {z['strategy']}",
                            "measured": r["time_vs_plain"], "predicted": t / plain["step_s"],
                            "note": f"sent {r['sent_vs_plain']:.2f}x, optimizer bytes "
                                    f"{r['optimizer_vs_plain']:.2f}x plain's (modelled: 1.00x, "
                                    f"0.50x); ZeRO's flat-buffer copies not modelled"},
                            saturated))
    return rows


def memory_rows(model, s):
    """schedules.json: the process's TF allocator peak over a step, K stages of M microbatches
    (SGD: no optimizer state), against the planner's memory of the K stages."""
    rows = []
    for r in s["rows"]:
        lay = planned(s["microbatch_size"] * r["M"], 1, pp=s["stages"],
                      microbatch=s["microbatch_size"])
        m = memory(model, lay, dataclasses.replace(FP32, schedule=r["schedule"]))
        rows.append(judged({"figure": f"schedules.json: {r['schedule']} M={r['M']} peak GB",
                            "measured": r["tf_peak_bytes"] / GB,
                            "predicted": s["stages"] * (m["total"] - m["optimizer"]) / GB,
                            "note": "the planner's memory of the stages, in one process"},
                           "the allocator's peak is not the planner's count: it keeps "
                           "Korthikanti's activations per microbatch (more than TF keeps: GPipe's "
                           "grow faster) and not the step's temporaries (most of 1F1B's flat "
                           "peak)"))
    return rows


def measured(bench_dir, model):
    """Every committed benchmark's figures, predicted from that benchmark's own inputs (Host,
    two_processes, ...): rows of figure, measured, predicted, error, within (±10 %), note, and
    reason when not within; fitted rows say so; inputs and missing benches are rows too."""
    h = host(bench_dir, model)
    bench = read_bench(bench_dir, "bench.json")
    peak = h.dev.fp32_flops * h.dev.per_node
    day = (f" (scaling.json's day: {peak / 1e9:.1f})"
           if abs(peak / bench["matmul_peak_flops"] - 1) > 1e-9 else "")
    rows = [{"figure": "bench.json: matmul peak",
             "input": f"{bench['matmul_peak_flops'] / 1e9:.1f} GFLOP/s{day} on {h.dev.per_node} "
                      f"cores; "
                      f"one unloaded core at {h.unloaded:.1%} of its share on gpt_mini "
                      f"(scaling.json, 1 process), rounds down to {h.spread:.2f} of it"}]
    for r in bench.get("rows", [])[1:]:  # the planner models the arithmetic, not the framework
        rows.append(judged({"figure": f"bench.json: {r['variant']} throughput vs tfdist",
                            "measured": r["relative_to_tfdist"], "predicted": 1.0,
                            "note": "the same arithmetic"}))
    for path in sorted(glob.glob(os.path.join(bench_dir, "allreduce*.json"))):
        name = os.path.basename(path)
        ar = read_bench(bench_dir, name)
        times = {impl: allreduce_time(ar, impl, model.params * 4)
                 for impl in ar["rows"][0] if impl != "size_mb"}
        rows.append({"figure": f"{name}: all-reduce of the gradients",
                     "input": ", ".join(f"{impl} {t:.3f} s" for impl, t in times.items())
                              + f" ({model.params * 4 / 1e6:.1f} MB)"})
    rows += [{"figure": n, "missing": BENCH_HINT[n]}
             for n in ("scaling.json", "scaling-horovod.json", "scaling-ps.json")
             if not read_bench(bench_dir, n)]
    names = [os.path.basename(p) for p in glob.glob(os.path.join(bench_dir, "scaling*.json"))]
    # loopback first
    for name in sorted(names, key=lambda n: (n.startswith("scaling-ps"), "bit" in n, n)):
        build = ps_row if name.startswith("scaling-ps") else scaling_row
        rows.append(build(h, model, bench_dir, name, read_bench(bench_dir, name)))
    for name, build in (("overlap.json", lambda d: overlap_rows(h, model, bench_dir, d)),
                        ("pipeline.json", lambda d: pipeline_rows(h, model, d)),
                        ("tensor.json", lambda d: [tensor_row(h, d)]),
                        ("zero.json", lambda d: zero_rows(h, model, bench_dir, "zero.json", d)),
                        ("zero-mwms.json",
                         lambda d: zero_rows(h, model, bench_dir, "zero-mwms.json", d)),
                        ("schedules.json", lambda d: memory_rows(model, d))):
        d = read_bench(bench_dir, name)
        if d:
            rows += build(d)
        elif name in BENCH_HINT:
            rows += [{"figure": name, "missing": BENCH_HINT[name]}]
    return rows
