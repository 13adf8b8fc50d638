"""What a strategy gives ZeRO: its data-parallel replicas' collectives.

A strategy that can shard declares `zero_collectives()` (`tfdist.strategies.base`), which returns
a `Collectives`: Horovod's reducescatter and allgather, or TF's collective ops under
multi_worker_mirrored. `local()` is one replica's, with which every stage computes what the plain
optimizer does (tests, examples).

Example:

    >>> from tfdist.parallel.zero.collectives import local
    >>> c = local()
    >>> c.rank, c.size
    (0, 1)
"""
import collections
import contextlib

Collectives = collections.namedtuple(
    "Collectives", "rank size reduce_scatter all_gather sum assign slot_scope ragged",
    defaults=(contextlib.nullcontext, False))
Collectives.__doc__ = """What a strategy gives ZeRO: this replica's `rank` of `size`;
`reduce_scatter(flat, name=None)`: this replica's 1/size of the flat buffer reduced over the
replicas (the strategy's op); `all_gather(flat, name=None)`: every replica's flat buffer, in rank
order, concatenated (`name`: the same on every replica, unique in a graph; ZeRO-3 names each);
`sum(scalar)`: the scalar summed over the replicas; `assign(variable, value)` from a replica;
`slot_scope()`: the context in which this replica's own slots are created; `ragged`: whether
`all_gather` takes buffers of different lengths (ZeRO-3 then sends its shares unpadded)."""


def local():
    """Collectives of one replica (N = 1): ZeRO's step is then the plain optimizer's."""
    return Collectives(0, 1, lambda x, name=None: x, lambda x, name=None: x, lambda x: x,
                       lambda v, x: v.assign(x))
