"""The framework's own time on this machine: what a step costs beyond the planner's arithmetic
(its matmuls, memory traffic and collectives), fitted on the small models of
`bench_results/auto.json` (`make bench-auto`: gpt_nano and gpt_mini, every runnable layout on 1
and 2 processes) and then used for every model (`Options.overheads`, tfdist/plan/model.py).

Each kind is a + b x P seconds, fitted by least squares on the residuals of the rows of that
kind (the measured step less the planner's prediction without it), each weighed by 1 / its step
squared (relative errors); P is the model's blocks for
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

A kind not measured has no overhead (0). GPT-2 124M and XL are not in the fit: they are what it
predicts (`tfdist plan --measured`). Where it misses them it is the offloads under ZeRO-3 and
ZeRO-2's copies: their cost a parameter falls between 10.8 M and 124 M (under ZeRO-3 on disk
3.1e-8 s at gpt_mini, 1.6e-8 at 124 M, 1.0e-8 at 1.56 B, left by those rows), which two small
models cannot show; a third size in the fit, or a term per variable beside the one per
parameter, would. The fit itself is `tfdist.plan.auto.fit_overheads` (it prices the bench's rows
as auto does).

    >>> from tfdist.plan import overheads
    >>> a, b = overheads.line([(1e5, 0.02), (1e7, 0.12)])  # (parameters, seconds): two points
    >>> round(a, 4), round(b * 1e9, 2)  # 19 ms, and 10.1 ns a parameter
    (0.019, 10.1)
"""
FIT_MODELS = ("gpt_nano", "gpt_mini")
KINDS = ("pass", "zero1", "zero2", "zero3", "offload_host", "offload_disk", "offload_host3",
         "offload_disk3")


def line(points):
    """(a, b) of a + b x P by weighted least squares on (P, seconds[, weight]) points (one
    point: b = 0). The fit weighs each row by 1 / its step squared: it minimises the steps'
    relative errors, so that a 124 M model's seconds do not drown a 0.1 M model's milliseconds."""
    pts = [(p[0], p[1], p[2] if len(p) > 2 else 1.0) for p in points]
    total = sum(w for _, _, w in pts)
    if not pts or total == 0:
        return (0.0, 0.0)
    mx = sum(w * x for x, _, w in pts) / total
    my = sum(w * y for _, y, w in pts) / total
    var = sum(w * (x - mx) ** 2 for x, _, w in pts)
    if len(pts) == 1 or var == 0:
        return (my, 0.0)
    b = sum(w * (x - mx) * (y - my) for x, y, w in pts) / var
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
