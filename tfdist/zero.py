"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, arXiv:1910.02054): the optimizer states of N
data-parallel replicas, and their summed gradients, sharded 1/N per replica.

Every replica still holds all the weights. Each trainable variable has one owner replica, and at
each update:

1. the gradients are reduce-scattered: each replica lays its local gradients out in one flat
   buffer, grouped by owner (each owner's segment padded to the longest), the buffers are summed
   (the strategy's all-reduce op: Horovod averages) and each replica receives only its segment;
2. each replica clips by the norm of the whole gradient (its segment's squared norm, summed over
   the replicas: `State.norm_sum`) and updates only the variables it owns; the optimizer's
   slots (AdamW's two moments) exist only for those;
3. the updated variables are all-gathered: each replica sends its segment and writes the others'.

Reduce-scatter plus all-gather move what one all-reduce moves, 2(N-1)/N of the gradient bytes.
The strategy gives the collectives (`Strategy.zero_collectives`): Horovod's, or TF's collective
ops under multi_worker_mirrored.

tfdist's training step (`tfdist.step`) runs these three at each update. Without gradient
accumulation, stage 1 and stage 2 run the same step: within one step a graph's gradients are
transient tensors under both. Stage 2 differs in the gradient memory that outlives a step: with
accumulation, stage 1 keeps an accumulator of every variable's local gradient, reduced at the
update, while stage 2 reduce-scatters every batch and accumulates only this replica's segment:
1/N of the bytes, for a reduce-scatter per batch instead of one exchange per update.

Partition: whole variables, largest first onto the least-loaded replica. Not flat buffers,
because the optimizer works per variable (AdamW excludes biases and norms from weight decay by
name), and so its slots keep the unsplit GPT's names in tfdist's layout-free checkpoints
(`tfdist.models.state`). A tensor-parallel layer's shards of one variable share an owner, for the
same reason. The cost is the imbalance, the largest share over the mean, which `describe`
reports.

Example (one replica, collectives that do nothing: the update is plain AdamW's):

    >>> import keras, numpy as np
    >>> from tfdist import zero
    >>> v = [keras.Variable(np.ones((4, 4), "float32")), keras.Variable(np.ones(4, "float32"))]
    >>> opt = keras.optimizers.AdamW(0.1)
    >>> sharded = zero.shard(opt, stage=1, collectives=zero.local())
    >>> opt.build(v)
    >>> mine = sharded.reduce_scatter([(np.ones((4, 4), "float32"), v[0]),
    ...                                (np.ones(4, "float32"), v[1])])
    >>> opt.apply([g for g, _ in mine], [x for _, x in mine])
    >>> sharded.gather()
    >>> zero.describe(opt)
    'ZeRO-1 over 1 replica(s): this replica owns 2 of 2 variables (20 of 20 parameters); imbalance 1.00'
"""
import collections
import contextlib
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfdist.data.store import write_atomic
from tfdist.errors import UsageError

#: False leaves out the all-gather: the replicas' weights then drift apart (tests show that the
#: equality tests can fail).
GATHER = True

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


def partition(sizes, n):
    """The owner (0..n-1) of each of `sizes`: largest first onto the least-loaded replica, ties
    to the lower index and the earlier variable, so every replica computes the same."""
    owners, load = [0] * len(sizes), [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owners[i], load[r] = r, load[r] + sizes[i]
    return owners


class Sharding:
    """The owners of an optimizer's variables and the flat layout of the collectives. Variables
    with the same `tfdist_shard_of` attribute (a tensor-parallel layer's shards of one kernel or
    bias: tfdist.models.tensor_parallel) get one owner, so a backup can save their slots as the
    unsplit variable's."""

    def __init__(self, variables, n, owner=None):
        self.variables = list(variables)
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        if owner is not None:  # ZeRO-3's (tfdist.zero3): the owner of each variable, by id
            self._set([owner[id(v)] for v in self.variables], n)
            return
        groups = {}  # group key -> indices, in the order of their first variable
        for i, v in enumerate(self.variables):
            groups.setdefault(getattr(v, "tfdist_shard_of", None) or ("variable", i), []).append(i)
        members = list(groups.values())
        owner_of = partition([sum(self.sizes[i] for i in m) for m in members], n)
        owners = [0] * len(self.variables)
        for m, owner in zip(members, owner_of):
            for i in m:
                owners[i] = owner
        self._set(owners, n)

    def _set(self, owners, n):
        self.owners = owners
        self.of = [[i for i, o in enumerate(self.owners) if o == r] for r in range(n)]
        self.loads = [sum(self.sizes[i] for i in idx) for idx in self.of]
        self.segment = max(self.loads) if self.loads else 0  # elements per replica, padded
        self.imbalance = self.segment / max(1.0, sum(self.loads) / n)

    def flat(self, tensors, r, zero=None, ragged=False):
        """Replica r's segment: its variables' tensors (one per variable; those of the others
        are not read), flattened, float32, zero-padded to the segment length (with `zero`, a
        scalar tensor, when given: ZeRO-3 pads from a runtime value, `tfdist.zero3`). `ragged`:
        unpadded, ending with one `zero` instead (`length(r, ragged)` long)."""
        parts = [tf.reshape(tf.cast(tensors[i], tf.float32), [-1]) for i in self.of[r]]
        pad = self.length(r, ragged) - self.loads[r]
        if zero is not None:
            return tf.concat(parts + [tf.fill([pad], zero)], 0)
        return tf.concat(parts + [tf.zeros([pad], tf.float32)], 0) if pad or not parts else \
            tf.concat(parts, 0)

    def length(self, r, ragged=False):
        """The elements of replica r's `flat` segment."""
        return self.loads[r] + 1 if ragged else self.segment

    def unflat(self, flat, r):
        """[(variable index, value)] of replica r's segment `flat`."""
        out, start = [], 0
        for i in self.of[r]:
            v = self.variables[i]
            out.append((i, tf.cast(tf.reshape(flat[start:start + self.sizes[i]], v.shape), v.dtype)))
            start += self.sizes[i]
        return out


class State:
    """A ZeRO optimizer's stage, collectives and (once built) sharding, at
    `optimizer.tfdist_zero`; what tfdist's training step (`tfdist.step`) calls at each update:
    `reduce_scatter` the gradients, `norm_sum` for clipping, then the optimizer's update of this
    replica's variables, then `gather` them."""

    def __init__(self, stage, collectives):
        self.stage, self.collectives = stage, collectives
        self.sharding, self.owned = None, set()
        self.slots = set()  # ids of this replica's slot variables: the shard of the state
        self.params = None  # ZeRO-3: the weights' sharding (tfdist.zero3.Parameters)

    def norm_sum(self, x):
        """`x` summed over the replicas (a squared norm: each holds its segment's)."""
        return self.collectives.sum(x)

    def reduce_scatter(self, grads_and_vars):
        """[(summed gradient, variable)] of this replica's variables (those with a gradient).
        ZeRO-3: the backward pass reduce-scattered them already (tfdist.zero3)."""
        s, c = self.sharding, self.collectives
        if self.stage == 3:
            return [(g, v) for g, v in grads_and_vars if g is not None and id(v) in self.owned]
        by_handle = {id(_handle(v)): g for g, v in grads_and_vars}
        grads = [by_handle.get(id(_handle(v))) for v in s.variables]
        dense = [tf.zeros(v.shape, tf.float32) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, s.variables)]
        mine = c.reduce_scatter(tf.concat([s.flat(dense, r) for r in range(c.size)], 0))
        return [(g, s.variables[i]) for i, g in s.unflat(mine, c.rank) if grads[i] is not None]

    def gather(self):
        """Every replica's updated variables to every replica (`GATHER` False: none)."""
        s, c = self.sharding, self.collectives
        if not GATHER or c.size == 1 or self.stage == 3:  # ZeRO-3: gathered where they are used
            return
        every = c.all_gather(s.flat([_handle(v) for v in s.variables], c.rank))
        for r in range(c.size):
            if r != c.rank:
                for i, value in s.unflat(every[r * s.segment:(r + 1) * s.segment], r):
                    c.assign(s.variables[i], value)


def common_variables(optimizer):
    """The optimizer's variables that every replica holds (all but ZeRO's slot shards): what a
    broadcast from one replica may set."""
    zero = getattr(optimizer, "tfdist_zero", None)
    return [v for v in optimizer.variables if zero is None or id(v) not in zero.slots]


def _handle(v):  # the tf.Variable of a Keras variable
    return v.value if isinstance(v, keras.Variable) else v


def shard(optimizer, stage, collectives, owner=None):
    """Makes `optimizer` a ZeRO-`stage` optimizer over `collectives`' replicas; returns its
    `State`. Stage 3: `owner` ({id(variable): replica}) is the weights' (tfdist.zero3). Its `build(variables)` partitions the variables and creates slots only for this
    replica's (in `collectives.slot_scope()`), so that it can update only those; its
    `add_slot(variable, name)` adds one more slot of the same kind (`None` for a variable this
    replica does not own), such as the step's gradient accumulators under ZeRO-2."""
    if stage not in (1, 2, 3) or (stage == 3) != (owner is not None):
        raise ValueError(f"ZeRO stage must be 1, 2, or 3 with the weights' owners; got {stage!r}")
    c = collectives
    zero = optimizer.tfdist_zero = State(stage, c)  # (a dict would be copied by Keras)
    build, add_slot = optimizer.build, optimizer.add_variable_from_reference

    def add_owned_slot(reference_variable, name=None, initializer="zeros"):
        if id(reference_variable) not in zero.owned:
            return None  # Keras's optimizers skip a None slot (as for overwrite_with_gradient)
        with c.slot_scope():
            slot = add_slot(reference_variable, name=name, initializer=initializer)
        zero.slots.add(id(slot))
        return slot

    def zero_build(variables):
        s = zero.sharding = Sharding(variables, c.size, owner)
        zero.owned = {id(s.variables[i]) for i in s.of[c.rank]}
        optimizer.add_variable_from_reference = add_owned_slot
        try:
            build(variables)
        finally:
            del optimizer.add_variable_from_reference  # Keras's own again

    optimizer.build = zero_build
    zero.add_slot = add_owned_slot
    return zero


def describe(optimizer):
    """One line: the stage, this replica's share and the partition's imbalance."""
    zero = getattr(optimizer, "tfdist_zero", None)
    if zero is None or zero.sharding is None:
        return "no ZeRO" if zero is None else f"ZeRO-{zero.stage} (not built yet)"
    if zero.params is not None:
        return zero.params.describe()
    s, c = zero.sharding, zero.collectives
    return (f"ZeRO-{zero.stage} over {c.size} replica(s): this replica owns "
            f"{len(s.of[c.rank])} of {len(s.variables)} variables ({s.loads[c.rank]:,} of "
            f"{sum(s.sizes):,} parameters); imbalance {s.imbalance:.2f}")


# -- backups: each replica's shard of the optimizer state --------------------------------------
#
# A ZeRO backup of step S is the usual checkpoint (weights, the optimizer's common variables,
# step; written by the chief) plus, in <backup>/zero/step-S/, one checkpoint per replica of its
# slots under the unsplit GPT's names, each followed by a manifest rank-<r>.json naming them.
# Every replica writes its shard before the chief's checkpoint index names step S, so a kill
# never leaves an index pointing at missing shards. A restore reads, for each slot it holds now,
# whichever shard has it: so the backup reshards to any number of replicas, or none.

def split_slots(optimizer, optimizer_state):
    """(slots, the rest) of `optimizer_state` ({name: variable}, tfdist.models.state): the slots
    are this replica's shard under ZeRO; without ZeRO, nothing is split off."""
    zero = getattr(optimizer, "tfdist_zero", None)
    if zero is None:
        return {}, optimizer_state
    parts = {k: getattr(v, "shards", [v]) for k, v in optimizer_state.items()}  # (joined shards)
    slots = {k: v for k, v in optimizer_state.items() if all(id(x) in zero.slots for x in parts[k])}
    held = sum(len(parts[k]) for k in slots)
    if held != len(zero.slots):  # a slot joined with another replica's: a partition error
        raise ValueError(f"{len(zero.slots) - held} ZeRO slot(s) are not in the state's names")
    return slots, {k: v for k, v in optimizer_state.items() if k not in slots}


class DamagedShards(UsageError):
    """A backup step whose shards are incomplete: the restore falls back to an older backup.
    `short`: the reason in a few words."""

    def __init__(self, message, short):
        super().__init__(message)
        self.short = short


def shard_dir(backup_dir, step):
    return os.path.join(backup_dir, "zero", f"step-{step}")


def save_shard(backup_dir, step, slots, rank, size, weights=None):
    """Writes this replica's `slots` ({name: variable}; ZeRO-3: and its `weights`) for step
    `step`, then its manifest."""
    d = shard_dir(backup_dir, step)
    tf.io.gfile.makedirs(d)
    parts = dict(optimizer=slots, **({"weights": weights} if weights else {}))
    tf.train.Checkpoint(**parts).write(os.path.join(d, f"rank-{rank}"))
    write_atomic(os.path.join(d, f"rank-{rank}.json"),
                 json.dumps({"rank": rank, "replicas": size, "names": sorted(slots),
                             "weights": sorted(weights or {})}))


def manifests(backup_dir, step):
    """The manifests of step `step`'s shards, one per replica that wrote one (`DamagedShards`,
    one line, when one is missing)."""
    d = shard_dir(backup_dir, step)
    found = []
    for path in sorted(tf.io.gfile.glob(os.path.join(d, "rank-*.json"))):
        with tf.io.gfile.GFile(path) as f:
            found.append(json.load(f))
    size = found[0]["replicas"] if found else 0
    missing = sorted(set(range(size)) - {m["rank"] for m in found})
    if not found or missing:
        raise DamagedShards(short=f"lacks the ZeRO optimizer shard(s) of replica(s) "
                                  f"{missing or 'all'}", message=(f"backup {backup_dir} at step {step} lacks the ZeRO optimizer shard(s) "
                            f"of replica(s) {missing or 'all'} in {d}; restore that directory, "
                            f"or remove the backup to start over"))
    return found


def wait_for_shards(backup_dir, step, timeout):
    """Returns once every replica's shard of step `step` is on disk (its manifest, written
    last); TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return manifests(backup_dir, step)
        except DamagedShards as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}'s shards are incomplete after {timeout:.0f} s: "
                                   f"{e.short}") from None
            time.sleep(0.05)


def restore_slots(backup_dir, step, slots, weights=None):
    """Restores `slots` ({name: variable}), and `weights` (ZeRO-3's), from the shards of step
    `step`. UsageError, one line, when a shard is missing or a variable is in none of them."""
    d, found, weights = shard_dir(backup_dir, step), set(), weights or {}
    for m in manifests(backup_dir, step):
        mine = {k: slots[k] for k in m["names"] if k in slots}
        my_weights = {k: weights[k] for k in m.get("weights", []) if k in weights}
        if mine or my_weights:
            parts = dict(optimizer=mine, **({"weights": my_weights} if my_weights else {}))
            tf.train.Checkpoint(**parts).read(  # (read: no save counter, as written)
                os.path.join(d, f"rank-{m['rank']}")).assert_existing_objects_matched()
        found |= set(mine) | {"weights/" + k for k in my_weights}
    lost = sorted((set(slots) | {"weights/" + k for k in weights}) - found)
    if lost:
        raise UsageError(f"backup {backup_dir} at step {step}: no shard holds {lost[:3]}; it was "
                         f"written for another model")


def shard_weight_names(backup_dir, step):
    """The weights that step `step`'s shards hold (ZeRO-3's; none for stages 1-2)."""
    return {n for m in manifests(backup_dir, step) for n in m.get("weights", [])}


def prune(backup_dir, oldest_kept):
    """Removes the shards of steps before `oldest_kept` (their checkpoints are gone)."""
    for d in tf.io.gfile.glob(os.path.join(backup_dir, "zero", "step-*")):
        if int(d.rsplit("-", 1)[1]) < oldest_kept:
            tf.io.gfile.rmtree(d)
