"""What a strategy gives tfdist's data-parallel communication: sums over groups of its workers.

A strategy whose workers reduce gradients (multi_worker_mirrored, horovod) declares
`dp_collectives()`, which returns a `Collectives`: where its workers are (`hosts`), and three
operations over a group of them, "all" (every worker), "local" (this worker's host) or "cross"
(the workers of its local rank, one per host: `tfdist.parallel.dp.hosts`). The hierarchical
all-reduce and the compressed sums are written once on top of them.

`name` is the same on every worker and unique in a graph (workers meet by it); each strategy
makes its keys from it.

Example (one worker, whose groups hold only itself):

    >>> import tensorflow as tf
    >>> from tfdist.parallel.dp.collectives import local
    >>> c = local()
    >>> c.all_reduce(tf.ones(2), "all", "x").numpy().tolist(), c.hosts.per_host
    ([1.0, 1.0], 1)
"""
import collections

from tfdist.parallel.dp.hosts import Hosts

Collectives = collections.namedtuple(
    "Collectives", "hosts reduce_scatter all_reduce all_gather all_to_all scale")
Collectives.__doc__ = """What a strategy gives data-parallel communication: `hosts` (a `Hosts`:
this worker's place); over `group` ("all", "local" or "cross"): `reduce_scatter(x, group,
name)`: `x` of shape [G, k] (G the group's size) summed over the group, this worker's row k
(its place in the group) returned, shape [k]; `all_reduce(x, group, name)`: `x` summed over the
group; `all_gather(x, group, name)`: every member's `x` concatenated along axis 0 in group
order; `all_to_all(x, group, name)`: `x` of shape [G, k], its row j sent to member j, the G
rows received in group order (shape [G, k]). `scale`: what the strategy's own gradient
reduction multiplies the sum by (1: a sum, as Keras's under tf.distribute; 1 / N: Horovod's
average)."""


def local():
    """One worker's collectives: each group is this worker alone."""
    return Collectives(Hosts(("localhost",), 0), lambda x, group, name: x[0],
                       lambda x, group, name: x, lambda x, group, name: x,
                       lambda x, group, name: x, 1.0)
