"""Every committed benchmark's figures predicted from that benchmark's own inputs, beside the
measured ones (`tfdist plan --measured`, `make plan-measured`): the host model of this machine is
in tfdist.plan.machine; here each bench's rows, judged within ±10 % or given their reason.
"""
import dataclasses
import glob
import math
import os
import statistics

from tfdist.plan.machine import (
    BENCH_HINT,
    COLLECTIVE,
    FP32,
    RING,
    allreduce_time,
    collective,
    host,
    link_rate,
    one_core,
    read_bench,
)
from tfdist.plan.model import GB, Cluster, memory, offload_io, planned, step_time
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


def overlap_rows(h, model, bench_dir, name, o):
    """overlap*.json: 2 processes against one, overlapped in buckets or not, on loopback or a
    shaped link. On loopback the whole all-reduce is the cores' work, so overlap hides none of
    it; on a link only the wire's part can hide. MultiWorkerMirrored with one inter-op thread hides
    nothing even there (`MWMS_LATE`)."""
    per = o["batch_per_process"]
    t1 = per * model.seq_len / o["rows"][0]["tokens_per_sec"]  # the "1 process" row
    grads = model.params * 4
    out = []
    for r in o["rows"][1:]:
        impl = collective(r["strategy"])
        link, ar_name, allreduce = _collective(bench_dir, o, impl, grads)
        if allreduce is None:
            return out + [{"figure": name, "missing": BENCH_HINT.get(ar_name, "make bench-links")}]
        wire = 0.0 if link == "loopback" else grads / link_rate(link)
        # (how each collective behaved in its profiled 1 Gbit/s step: the overlap-trace files)
        late = impl == RING and o.get("inter_op_threads") == 1 and wire > 0
        traced = impl in TRACED_HIDDEN and r["overlap"] == "on" and wire > 0
        opts = dataclasses.replace(FP32, overlap=r["overlap"] == "on" and not (late or traced),
                                   bucket_bytes=(r["bucket_mb"] or 25) * 2 ** 20)
        t2, load = two_processes(h, model, per, t1, allreduce, wire, link != "loopback", opts)
        if traced:  # the share of the wire the profiled step hid
            t2 -= TRACED_HIDDEN[impl] * wire
        note = f"{link}: 1 process {t1:.2f} s; {_day(h, load)}" + (
            f"; {MWMS_LATE}" if late and r["overlap"] == "on" else "") + (
            f"; {HOROVOD_TRACED}" if traced else "")
        out.append(judged({"figure": f"{name}: {r['variant']}, 2 processes vs 1",
                           "measured": r["efficiency"], "predicted": t1 / t2, "note": note},
                          why_off(name, r["efficiency"], t1 / t2, r.get("per_round", ()), load)))
    return out


TRACED_HIDDEN = {COLLECTIVE["horovod"]: 0.39}  # Gloo's share of the wire hidden, traced
HOROVOD_TRACED = ("Horovod's background thread hid 39 % of the wire's time behind the backward "
                  "pass in its profiled 1 Gbit/s step (overlap-trace-horovod-1gbit.json, "
                  "docs/benchmarks.md 'Why 70 %'), not the bucket model's share: priced at 39 %")
MWMS_LATE = ("MWMS with one inter-op thread issues its first bucket after the backward pass "
             "(overlap-trace-multi_worker_mirrored-1gbit.json: 0 % hidden on one worker): "
             "priced as not overlapped")


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
    """zero*.json: ZeRO-1/2/3's step against plain data parallel's, 2 processes on loopback. ZeRO's
    reduce-scatter and all-gather move the all-reduce's bytes (the cores' work either way, not
    hidden; ZeRO-3 1.5x, gathering the weights again for the backward pass), the update's memory
    traffic is inside the fitted fraction of peak on this CPU, and the framework's own time for
    each stage (its flat buffers' copies; ZeRO-3's gathers) is the one fitted on auto.json's
    small models (tfdist.plan.overheads)."""
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
    fitted = _machine(bench_dir).overheads or {}
    o = dataclasses.replace(o, overheads={k: v for k, v in fitted.items()
                                          if k.startswith("zero")} or None)
    rows = []
    for r in z["rows"][1:]:
        kept = "kept" in r["variant"]
        parts = step_time(model, cluster, dataclasses.replace(lay, zero=r["stage"]), o)
        t = parts["total"]
        if kept:  # one gather a step: the plain all-reduce's bytes, half the gathers' overhead
            t = step_time(model, cluster, lay, o)["total"] + parts["framework"] / 2
        rows.append(judged({"figure": f"{name}: {r['variant']} step vs plain, {z['strategy']}",
                            "measured": r["time_vs_plain"], "predicted": t / plain["step_s"],
                            "note": f"sent {r['sent_vs_plain']:.2f}x plain's (modelled: "
                                    f"{1.5 if r['stage'] == 3 and not kept else 1:.2f}x); the "
                                    f"framework's {parts['framework']:.3f} s (auto.json's fit)"
                                    + ("; kept: one gather a step, half of it" if kept else "")},
                           saturated))
    return rows


def _machine(bench_dir):
    """tfdist.plan.auto's Machine of bench_dir's benches (cached: the fit reads auto.json)."""
    key = os.path.abspath(bench_dir)
    if key not in _MACHINES:
        from tfdist.plan import auto
        _MACHINES[key] = auto.benched(bench_dir)
    return _MACHINES[key]


_MACHINES = {}


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


def auto_rows(bench_dir, a):
    """auto.json: each measured layout's seconds an update against the planner's (the one
    `--config.layout=auto` ranks by: tfdist.plan.auto, with the framework's own time fitted on
    the small models' rows, which are marked fitted), and auto's pick against the best measured
    layout (its tokens/s over the best's: 1 is a perfect pick)."""
    from tfdist.plan import auto, overheads
    machine = _machine(bench_dir)
    rows = []
    for case in a.get("cases", []):
        if "config" not in case:
            continue
        name, w = case["model"], case["workers"]
        fitted = name in overheads.FIT_MODELS
        for cand, row in auto.bench_candidates(case, machine, os.path.dirname(
                os.path.abspath(bench_dir))):
            r = judged({"figure": f"auto.json: {name} x{w} {cand.layout.describe()}, s/update",
                        "measured": row["seconds_per_update"], "predicted": cand.seconds,
                        "note": f"framework {cand.parts.get('framework', 0.0):.3f} s of it"},
                       _framework_off(cand, row["seconds_per_update"], w))
            if fitted:
                r.update(fitted=True, note="a row of the framework time's fit: " + r["note"])
                if not r["within"]:
                    r["reason"] = ("a row of the fit, which is a + b x P through every row of "
                                   "its kind (1 and 2 processes, both small models): its "
                                   "residual, on steps of tens of milliseconds")
            rows.append(r)
        if "auto_over_best" in case:
            rows.append(judged({"figure": f"auto.json: {name} x{w} auto's tokens/s vs the best "
                                          f"layout's", "measured": case["auto_over_best"],
                                "predicted": 1.0,
                                "note": f"chose {case['chosen']}; best {case['best']}"},
                               _pick_off(case)))
    return rows


def _bench_setting(bench_dir, config, seq, batch, workers=1):
    """(config, Model, Cluster, Options) of a bench's Horovod run of `config` (float32, `batch`
    sequences of `seq` tokens per update, `workers` ranks on this host), as auto prices it."""
    from tfdist.plan import auto
    from tfdist.strategies import get_class
    c = auto.bench_config(os.path.join(os.path.dirname(os.path.abspath(bench_dir)), config), seq,
                          batch)
    return (c, *auto.setting(c, get_class("horovod"), workers, workers, _machine(bench_dir)))


def offload_rows(bench_dir, o):
    """offload.json: gpt_mini under ZeRO-3 on one Horovod rank, 4 x 256 tokens: the step with
    its state on disk against the resident one (ratios of one round), as auto prices them; with
    prefetch off, the CPU step's reads, update and writes one after the other instead of
    overlapped."""
    from tfdist.plan import auto
    c, model, cluster, opts = _bench_setting(bench_dir, "configs/gpt_mini.py", 256, 4)
    lay = dataclasses.replace(planned(4, 1, microbatch=4, zero=3), seq=256)
    resident = auto.price(c, model, cluster, opts, lay).seconds
    disk = dataclasses.replace(lay, offload="disk")
    t = auto.price(c, model, cluster, opts, disk).seconds
    io = offload_io(model, disk, opts)
    n = model.params
    serial = (io["read"] - 2 * n * 4) / opts.disk_read_bw + io["written"] / opts.disk_write_bw \
        + n / opts.cpu_adam_disk_rate
    rows = []
    measured_resident = statistics.median(o["step_s"]["resident"])
    for variant, predicted in (("disk", t / resident),
                               ("disk, prefetch off", (t - io["update_s"] + serial) / resident)):
        added = statistics.median(o["step_s"][variant]) - measured_resident
        rows.append(judged({"figure": f"offload.json: ZeRO-3 {variant} step vs resident",
                            "measured": o["median_ratio"][variant], "predicted": predicted,
                            "note": f"resident {resident:.3f} s predicted (measured "
                                    f"{measured_resident:.3f} s)"},
                           f"the offload adds {(predicted - 1) * resident:.3f} s priced against "
                           f"{added:.3f} s measured, to a resident step priced {resident:.3f} s "
                           f"against {measured_resident:.3f} s: without prefetch the reads, "
                           f"update and writes of the CPU step run one after another, and the "
                           f"framework's time fitted with prefetch on is short of them"))
    return rows


def offload_xl_row(bench_dir, x):
    """offload-xl.json: GPT-2 XL's step with ZeRO-3 and its state on disk, one rank, 1 x 256
    tokens, float32, under a 20 GiB cgroup: seconds, as auto prices it."""
    from tfdist.plan import auto
    c, model, cluster, opts = _bench_setting(bench_dir, "configs/gpt2_xl.py", x["seq"],
                                             x["batch"])
    lay = dataclasses.replace(planned(x["batch"], 1, microbatch=x["batch"], zero=3),
                              seq=x["seq"], offload="disk")
    cand = auto.price(c, model, cluster, opts, lay)
    p = cand.parts
    return [judged({"figure": "offload-xl.json: GPT-2 XL ZeRO-3 on disk, s/step",
                    "measured": x["runs"]["disk"]["step_s"], "predicted": cand.seconds,
                    "note": f"compute {p['compute']:.1f} s, CPU step and reads "
                            f"{p['memory']:.1f} s, framework {p['framework']:.1f} s "
                            f"(auto.json's fit)"},
                   _framework_off(cand, x["runs"]["disk"]["step_s"], 1)
                   + f"; and its CPU step took {x['runs']['disk']['cpu_step_s']:.1f} s against "
                     f"{offload_io(model, lay, opts)['update_s']:.1f} s priced")]


def _pick_off(case):
    """Why auto's tokens/s is off the best's by more than 10 %: the same layout (two runs of it,
    one each), or another one."""
    if case["chosen"] == case["best"]:
        return (f"auto chose the best layout itself: its run and the best's are two runs of "
                f"one layout, {abs(case['auto_over_best'] - 1):.0%} apart (one run each; "
                f"this machine is shared)")
    return None


def _framework_off(cand, measured, workers):
    """Why a predicted step misses: the framework's time fitted on the small models against what
    the row leaves beyond the planner's arithmetic (both in seconds)."""
    from tfdist.plan import overheads
    fw = cand.parts.get("framework", 0.0)
    left = measured - (cand.seconds - fw)
    kind = overheads.kind_of(cand.layout) or "pass"
    return (f"the framework's time: {fw:.2f} s fitted on {', '.join(overheads.FIT_MODELS)} "
            f"({kind}, a + b x P), {left:.2f} s left by this row beyond the arithmetic, at "
            f"{cand.model.params / 1e6:,.0f} M parameters on {workers} process(es): the fitted "
            f"rate does not hold here")


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
    for name, build in (("overlap.json",
                         lambda d: overlap_rows(h, model, bench_dir, "overlap.json", d)),
                        ("overlap-1gbit.json",
                         lambda d: overlap_rows(h, model, bench_dir, "overlap-1gbit.json", d)),
                        ("pipeline.json", lambda d: pipeline_rows(h, model, d)),
                        ("tensor.json", lambda d: [tensor_row(h, d)]),
                        ("zero.json", lambda d: zero_rows(h, model, bench_dir, "zero.json", d)),
                        ("zero-mwms.json",
                         lambda d: zero_rows(h, model, bench_dir, "zero-mwms.json", d)),
                        ("schedules.json", lambda d: memory_rows(model, d)),
                        ("auto.json", lambda d: auto_rows(bench_dir, d)),
                        ("offload.json", lambda d: offload_rows(bench_dir, d)),
                        ("offload-xl.json", lambda d: offload_xl_row(bench_dir, d))):
        d = read_bench(bench_dir, name)
        if d:
            rows += build(d)
        elif name in BENCH_HINT:
            rows += [{"figure": name, "missing": BENCH_HINT[name]}]
    return rows
