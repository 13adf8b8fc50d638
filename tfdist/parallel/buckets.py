"""Gradient buckets: the all-reduce cut into pieces that start while the backward pass still runs.

The backward pass produces gradients in about the reverse order of the model's variables: the
head's and the last block's first, the embedding's last. A single all-reduce of every gradient
waits for the whole backward pass. Cut into buckets of about `bucket_bytes`, taken in that reverse
order, each bucket's all-reduce depends only on its own gradients; TensorFlow's executor starts
it as soon as they exist, and the communication (an asynchronous op: Horovod's background thread,
TF's collective executor) runs while the earlier layers are still being differentiated. The
update waits only for the reduced gradients. This is what PyTorch DDP (`bucket_cap_mb`, 25 MiB)
and Megatron-LM do.

Bucketing changes when gradients are reduced, not what: each element is still reduced once,
over the same replicas, so the sums are the same.

`strategy.bucket_mb` sets the size (MiB, as DDP's; > 0) and `strategy.overlap` whether to
overlap at all (`auto`, `on`, `off`: one all-reduce after the backward pass). Both are options of
the strategies that reduce gradients across processes (multi_worker_mirrored, horovod).

Example: 4 gradients of 10, 10, 30 and 5 MiB in buckets of 25 MiB, the last variables first:

    >>> from tfdist.parallel import buckets
    >>> buckets.plan([10 << 20, 10 << 20, 30 << 20, 5 << 20], 25 << 20)
    [[3, 2], [1, 0]]
"""

from tfdist.runtime.lazy import tf

MIB = 1 << 20
#: The name scope of the gradients' collectives (tfdist.runtime.profiling finds them by it).
GRADIENT_SCOPE = "tfdist_reduce"
BUCKET_MB = 25.0  # PyTorch DDP's default
#: Values of `strategy.overlap`: `auto` overlaps wherever tfdist's gradient path allows it (not
#: under ZeRO, whose reduce-scatter takes every gradient at once), `on` insists (refused with
#: ZeRO: tfdist.parallel.layout), `off` does not.
OVERLAP = ("auto", "on", "off")

#: The strategy options (`config.strategy.<key>`) of a plugin that reduces gradients in buckets.
OPTIONS = {
    "bucket_mb": (BUCKET_MB, lambda v: not isinstance(v, bool) and v > 0,
                  "a gradient bucket size in MiB, > 0 (for example 25)"),
    "overlap": ("auto", lambda v: v in OVERLAP,
                "one of " + ", ".join(OVERLAP) + " (overlap the gradient all-reduce with the "
                "backward pass)"),
}


def to_bytes(bucket_mb):
    return max(1, round(float(bucket_mb) * MIB))


def plan(sizes, bucket_bytes):
    """Buckets of the indices of gradients of `sizes` bytes: walking from the last to the first,
    a bucket is closed once it holds `bucket_bytes` or more (a larger gradient has one to
    itself). The order of the buckets is the order in which their all-reduces should start."""
    out = []
    current = []  # the bucket being filled
    held = 0  # its bytes
    for i in reversed(range(len(sizes))):
        current.append(i)
        held += sizes[i]
        if held >= bucket_bytes:
            out.append(current)
            current = []
            held = 0
    if current:
        out.append(current)
    return out


def nbytes(grad, variable):
    """Bytes of `grad` as sent: its variable's elements at the gradient's dtype (an
    IndexedSlices' size is known only when it runs)."""
    count = 1
    for d in variable.shape:
        count *= int(d)
    return count * grad.dtype.size


def describe(sizes, bucket_bytes, overlap):
    """One line for the run's log: how the gradients are reduced."""
    total = sum(sizes)
    if not overlap:
        return f"gradients: one all-reduce of {total / MIB:.1f} MiB after the backward pass"
    groups = plan(sizes, bucket_bytes)
    return (f"gradients: {len(groups)} bucket(s) of <= {bucket_bytes / MIB:.3g} MiB "
            f"({total / MIB:.1f} MiB in all), each all-reduced as soon as the backward pass has "
            f"produced it")


_logged = set()


def say_once(line):
    """Prints `line` once per process (a step is traced more than once)."""
    if line not in _logged:
        _logged.add(line)
        print(line, flush=True)


def log_once(sizes, bucket_bytes, strategy):
    """Prints `describe` once per process and layout, when the train step is traced."""
    say_once(f"tfdist: {strategy}: {describe(sizes, bucket_bytes, bool(bucket_bytes))}")


def reduce(grads_and_vars, reduce_group, bucket_bytes=None, log=None):
    """`grads_and_vars` with every gradient reduced by `reduce_group(grads) -> reduced`, called
    once per bucket, the buckets in `plan`'s order; one call of every gradient when
    `bucket_bytes` is None (no overlap). Missing (None) gradients stay None. `log`: the strategy's
    name, to say how once (the chief)."""
    grads_and_vars = list(grads_and_vars)
    present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
    sizes = [nbytes(*grads_and_vars[i]) for i in present]
    if log:
        log_once(sizes, bucket_bytes, log)
    groups = plan(sizes, bucket_bytes) if bucket_bytes else [list(range(len(present)))]
    out = list(grads_and_vars)
    for group in groups:
        # (tfdist.runtime.profiling finds the gradients' collectives by the scope)
        with tf.name_scope(GRADIENT_SCOPE):
            reduced = reduce_group([grads_and_vars[present[k]][0] for k in group])
        for k, g in zip(group, reduced):
            out[present[k]] = (g, grads_and_vars[present[k]][1])
    return out
