"""The hierarchical all-reduce: reduce-scatter inside each host, all-reduce across the hosts
between equal local ranks, all-gather inside each host (Horovod's
`HOROVOD_HIERARCHICAL_ALLREDUCE`, which its Gloo path lacks; NCCL's tree of rings).

With H hosts of L workers and S bytes of gradients, a flat ring over the N = H x L workers sends
2(N-1)/N x S out of each worker, and its hops between hosts carry it: a ring in host order
crosses each host's link once each way, but with every worker's share of S on it; a ring whose
neighbours alternate between hosts (workers placed a, b, a, b) crosses at every hop, L times as
much. Here each worker first owns 1/L of the host's sum (reduce-scatter over the local group: no
link), then the L workers of each host all-reduce their 1/L across the hosts, in parallel (each
host's link carries 2(H-1)/H x S/L per worker, 2(H-1)/H x S in all: the minimum for a sum
every host ends up holding), then the host's workers gather the L pieces (no link).

Every element is still summed once over every worker, in another order: a result equal to the
flat sum up to float rounding.

Example (one worker: each phase is the identity):

    >>> import tensorflow as tf
    >>> from tfdist.parallel.dp import collectives, hierarchy
    >>> hierarchy.sum_flat(tf.range(5.0), collectives.local(), "g").numpy().tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0]
"""
from tfdist.runtime.lazy import tf


def sum_flat(flat, c, name):
    """`flat` (a 1-D tensor) summed over every worker of `c` (`Collectives`) in three phases:
    local reduce-scatter, cross all-reduce, local all-gather. A phase over a group of one is
    left out."""
    hosts = c.hosts
    local, cross = len(hosts.local), len(hosts.cross)
    n = int(flat.shape[0])  # (gradients' shapes are static)
    if local > 1:
        rows = tf.reshape(tf.pad(flat, [[0, (-n) % local]]), [local, -1])
        piece = c.reduce_scatter(rows, "local", f"{name}/scatter")
    else:
        piece = flat
    if cross > 1:
        piece = c.all_reduce(piece, "cross", f"{name}/across")
    if local > 1:
        return c.all_gather(piece, "local", f"{name}/gather")[:n]
    return piece


def sum_tensors(tensors, c, name):
    """Each of `tensors` summed over every worker (`sum_flat` of their concatenation, in
    float32), at its own shape and dtype."""
    return concatenated(tensors, lambda flat: sum_flat(flat, c, name))


def concatenated(tensors, flat_sum):
    """`tensors` summed as one: `flat_sum` of their float32 concatenation (1-D) split back,
    each at its own shape and dtype (the hierarchy's, and the compressed sums' plain part)."""
    flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], 0)
    total = flat_sum(flat)
    sizes = [t.shape.num_elements() for t in tensors]
    return [tf.cast(tf.reshape(part, tf.shape(t)), t.dtype)
            for part, t in zip(tf.split(total, sizes), tensors)]
