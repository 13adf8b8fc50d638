"""Which replica owns each variable, and the flat layout of ZeRO's collectives over them.

ZeRO partitions whole variables, not flat buffers: the optimizer works per variable (AdamW
excludes biases and norms from weight decay by name), and tfdist's layout-free backups keep
each slot under the unsplit GPT's names (`tfdist.models.state`). A tensor-parallel layer's
shards of one weight (the same `tfdist_shard_of`) are one item with one owner, for the same
reason. The cost is the imbalance, the largest share over the mean, which each stage reports.

Every stage uses the one greedy rule here (`partition`), so every replica computes the same
owners. Stages 1 and 2 partition the trainable variables once; stage 3 partitions each unit's
variables on their own, balanced against what the units before it placed, so that each gather's
shares are close (`tfdist.parallel.zero.weights`).

Example:

    >>> from tfdist.parallel.zero.partition import partition
    >>> partition([100, 7, 50, 50, 3, 90], 2)
    [0, 1, 1, 0, 1, 1]
"""
import math

from tfdist.runtime.lazy import tf


def partition(sizes, n, loads=None):
    """The owner (0..n-1) of each of `sizes`: largest first onto the replica least loaded by this
    call, then by `loads` (the replicas' loads before it, updated in place), ties to the lower
    index and the earlier item, so that every replica computes the same."""
    loads = [0] * n if loads is None else loads
    owners = [0] * len(sizes)
    mine = [0] * n  # each replica's load by this call
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (mine[r], loads[r], r))
        owners[i] = r
        mine[r] += sizes[i]
        loads[r] += sizes[i]
    return owners


def count(shape):
    """The elements of a variable of `shape`."""
    return math.prod(int(d) for d in shape)


def owners(variables, n, loads=None):
    """{id(variable): owner} of `variables` by `partition`, each tensor-parallel weight's shards
    (one `tfdist_shard_of`) as one item. `loads`: as `partition`'s."""
    groups = {}  # group key -> indices, in the order of their first variable
    for i, v in enumerate(variables):
        groups.setdefault(getattr(v, "tfdist_shard_of", None) or ("variable", i), []).append(i)
    members = list(groups.values())
    sizes = [sum(count(variables[i].shape) for i in m) for m in members]
    return {id(variables[i]): r
            for m, r in zip(members, partition(sizes, n, loads)) for i in m}


class Partition:
    """`variables` owned by `n` replicas (`owner`: {id(variable): replica}; default: `owners`),
    and the flat layout of a collective over them: replica r's segment holds its variables, in
    order, flattened to float32."""

    def __init__(self, variables, n, owner=None):
        self.variables = list(variables)
        self.sizes = [count(v.shape) for v in self.variables]
        owner = owners(self.variables, n) if owner is None else owner
        self.owners = [owner[id(v)] for v in self.variables]
        self.of = [[i for i, o in enumerate(self.owners) if o == r] for r in range(n)]
        self.loads = [sum(self.sizes[i] for i in idx) for idx in self.of]
        self.segment = max(self.loads) if self.loads else 0  # elements per replica, padded
        self.imbalance = self.segment / max(1.0, sum(self.loads) / n)

    def flat(self, tensors, r, pad=None, ragged=False):
        """Replica r's segment: its variables' tensors (one per variable; the others' are not
        read), flattened, float32, padded to the segment length with zeros, or with `pad` (a
        scalar tensor: ZeRO-3 pads from a runtime value). `ragged`: unpadded, ending with one
        `pad` instead (`length(r, ragged)` long)."""
        parts = [tf.reshape(tf.cast(tensors[i], tf.float32), [-1]) for i in self.of[r]]
        fill = self.length(r, ragged) - self.loads[r]
        if pad is not None:
            return tf.concat(parts + [tf.fill([fill], pad)], 0)
        if fill or not parts:
            return tf.concat(parts + [tf.zeros([fill], tf.float32)], 0)
        return tf.concat(parts, 0)

    def length(self, r, ragged=False):
        """The elements of replica r's `flat` segment."""
        return self.loads[r] + 1 if ragged else self.segment

    def unflat(self, flat, r):
        """[(variable index, value)] of replica r's segment `flat`."""
        out, start = [], 0
        for i in self.of[r]:
            v = self.variables[i]
            value = tf.reshape(flat[start:start + self.sizes[i]], v.shape)
            out.append((i, tf.cast(value, v.dtype)))
            start += self.sizes[i]
        return out
