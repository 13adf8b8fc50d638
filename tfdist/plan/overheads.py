"""The framework's own time on this machine: what a step costs beyond the planner's arithmetic
(its matmuls, memory traffic and collectives), fitted on the small models of
`bench_results/auto.json` (`make bench-auto`: gpt_nano and gpt_mini, every runnable layout on 1
and 2 processes) and then used for every model (`Options.overheads`, tfdist/plan/model.py).

Each kind is a + b x P seconds, fitted by least squares on the residuals of the rows of that
kind (the measured step less the planner's prediction without it); P is the model's blocks for
a pass (its ops are dispatched one by one: the time goes with their number, not their size), and
its parameters for the rest (copies: ZeRO's flat buffers, the CPU step's shard, on cores the
processes share):

    pass          every forward and backward pass (Keras's and tfdist's step: op dispatch, the
                  optimizer's per-variable update, a small model's fixed cost)
    zero1 .. 3    an update under ZeRO-k beyond plain data parallelism's (the flat buffers'
                  copies, the partition's slicing; ZeRO-3's gathers per pass)
    offload_host  an update offloaded (ZeRO-1/2) beyond the planner's CPU step and disk I/O (the
    offload_disk  host copies into and out of the store, a sub-group's Python work)
    offload_host3, offload_disk3: the same under ZeRO-3 (the master weights too)

A kind not measured has no overhead (0). The bigger models of the bench (GPT-2 124M, XL) are not
in the fit: they are what it predicts (`tfdist plan --measured`).

    >>> from tfdist.plan import overheads
    >>> a, b = overheads.line([(1e5, 0.02), (1e7, 0.12)])  # (parameters, seconds): two points
    >>> round(a, 4), round(b * 1e9, 2)  # 19 ms, and 10.1 ns a parameter
    (0.019, 10.1)
"""
import dataclasses
import os

FIT_MODELS = ("gpt_nano", "gpt_mini")
KINDS = ("pass", "zero1", "zero2", "zero3", "offload_host", "offload_disk", "offload_host3",
         "offload_disk3")


def line(points):
    """(a, b) of a + b x P by least squares on (P, seconds) points (one point: b = 0)."""
    n = len(points)
    if n == 0:
        return (0.0, 0.0)
    mx = sum(p for p, _ in points) / n
    my = sum(s for _, s in points) / n
    var = sum((p - mx) ** 2 for p, _ in points)
    if n == 1 or var == 0:
        return (my, 0.0)
    b = sum((p - mx) * (s - my) for p, s in points) / var
    return (my - b * mx, b)


def seconds(overheads, kind, model, replicas=1):
    """Seconds of overhead `kind` for `model` (a tfdist.plan.model.Model) over `replicas`."""
    a, b = (overheads or {}).get(kind, (0.0, 0.0))
    return a + b * _x(kind, model, replicas)


def _x(kind, model, replicas):
    """The blocks for a pass; the model's parameters otherwise: ZeRO's whole flat buffers, and an
    offload's copies, which each process makes of its shard, but on cores the processes of a host
    share (on this 2-core host, 2 processes' offloaded steps took as long as one's whole:
    auto.json's gpt2 rows; `replicas` is kept for hosts of their own)."""
    del replicas
    return model.n_layer if kind == "pass" else model.params


def kind_of(layout):
    """The overhead kind of `layout` beyond its passes (None: plain data parallelism)."""
    if layout.offload != "none":
        return f"offload_{layout.offload}" + ("3" if layout.zero >= 3 else "")
    return f"zero{layout.zero}" if layout.zero else None


def fit(bench_dir, machine):
    """{kind: (a, b)} from bench_dir/auto.json's rows of FIT_MODELS (empty without it), priced on
    `machine` (a tfdist.plan.auto.Machine, its overheads left out)."""
    from tfdist.plan import auto
    from tfdist.plan.machine import read_bench
    bench = read_bench(bench_dir, "auto.json") or {}
    bare = dataclasses.replace(machine, overheads={})
    residuals = {k: [] for k in KINDS}
    predicted = {}
    for case in bench.get("cases", []):
        if case["model"] not in FIT_MODELS or "config" not in case:
            continue
        for cand, row in _matched(case, bare, os.path.dirname(bench_dir)):
            predicted[(case["model"], case["workers"], row["layout"])] = (cand, row)
    for cand, row in predicted.values():  # passes first: plain rows
        if kind_of(cand.layout) is None:
            residuals["pass"].append((_x("pass", cand.model, 1),
                                      (row["seconds_per_update"] - cand.seconds)
                                      / cand.layout.passes))
    out = {"pass": line(residuals["pass"])}
    for cand, row in predicted.values():
        kind = kind_of(cand.layout)
        if kind is None:
            continue
        passes = cand.layout.passes * seconds(out, "pass", cand.model)
        per = cand.layout.passes if kind == "zero3" else 1
        residuals[kind].append((_x(kind, cand.model, cand.layout.dp),
                                (row["seconds_per_update"] - cand.seconds - passes) / per))
    out.update({k: line(v) for k, v in residuals.items() if k != "pass" and v})
    del auto
    return out


def _matched(case, machine, root):
    """(Candidate, bench row) of each measured row of an auto.json case, priced now."""
    from tfdist import config as config_lib
    from tfdist.plan import auto
    from tfdist.plan.report import load_config
    from tfdist.strategies import get_class
    c = load_config(os.path.join(root, case["config"]))
    c.model.block_size = case["seq"]
    c.train.update(batch_size=case["batch"], grad_accum_steps=1, steps=case["updates"],
                   steps_per_epoch=case["updates"], warmup_steps=1, precision="float32",
                   memory_gb=0.0)
    c.backup.enabled = False
    config_lib.validate(c)
    w = case["workers"]
    by_layout = {str(x.layout): x for x in auto.candidates(c, get_class("horovod"), w, w, machine)}
    for row in case["rows"]:
        if "seconds_per_update" in row and row["layout"] in by_layout:
            yield by_layout[row["layout"]], row
