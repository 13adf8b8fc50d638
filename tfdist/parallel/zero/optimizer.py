"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, arXiv:1910.02054): the optimizer states of N
data-parallel replicas, and their summed gradients, sharded 1/N per replica.

Every replica still holds all the weights. Each trainable variable has one owner replica
(`tfdist.parallel.zero.partition`), and at each update:

1. the gradients are reduce-scattered: each replica lays its local gradients out in one flat
   buffer, grouped by owner (each owner's segment padded to the longest), the buffers are summed
   (the strategy's all-reduce op: Horovod averages) and each replica receives only its segment;
2. each replica clips by the norm of the whole gradient (its segment's squared norm, summed over
   the replicas: `norm_sum`) and updates only the variables it owns; the optimizer's slots
   (AdamW's two moments) exist only for those;
3. the updated variables are all-gathered: each replica sends its segment and writes the others'.

Reduce-scatter plus all-gather move what one all-reduce moves, 2(N-1)/N of the gradient bytes.

Without gradient accumulation, stage 1 and stage 2 run the same step: within one step a graph's
gradients are transient tensors under both. Stage 2 differs in the gradient memory that outlives
a step: with accumulation, stage 1 keeps an accumulator of every variable's local gradient,
reduced at the update, while stage 2 reduce-scatters every batch and accumulates only this
replica's segment: 1/N of the bytes, for a reduce-scatter per batch instead of one exchange per
update. So `ShardedGradients` (2) is `ShardedOptimizer` (1) with the reduction moved from the
update to each batch, and accumulators for its own variables only.

Example (one replica, collectives that do nothing: the update is plain AdamW's):

    >>> import keras, numpy as np
    >>> from tfdist.parallel import zero
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    >>> opt = keras.optimizers.AdamW(0.1)
    >>> sharded = zero.make(1, model, zero.local())
    >>> sharded.build(opt)
    >>> grads = [(np.ones(v.shape, "float32"), v) for v in model.trainable_weights]
    >>> mine = sharded.update_gradients(sharded.batch_gradients(grads))
    >>> opt.apply([g for g, _ in mine], [v for _, v in mine])
    >>> sharded.after_update()
    >>> print(sharded.describe())  # doctest: +NORMALIZE_WHITESPACE
    ZeRO-1 over 1 replica(s): this replica owns 2 of 2 variables (20 of 20 parameters);
    imbalance 1.00
"""
import contextlib

import keras

from tfdist.parallel.zero.partition import Partition
from tfdist.parallel.zero.stage import Stage
from tfdist.runtime.lazy import tf


class ShardedOptimizer(Stage):
    """ZeRO stage 1 of `model` over `collectives`' replicas (a
    `tfdist.parallel.zero.collectives.Collectives`): each replica holds the optimizer's slots of
    the variables it owns. `skip`: collectives to leave out, "all_gather" or "reduce_scatter"
    (a companion test's: the replicas then drift apart). `offload`: a
    `tfdist.parallel.zero.offload.Offload` that holds the slots off the device instead, and
    steps them on the CPU."""

    stage = 1

    def __init__(self, model, collectives, skip=(), offload=None):
        super().__init__(model, reduce=None)
        self.collectives = collectives
        self.skip = frozenset(skip)
        self.offload = offload
        self.partition = None  # (once built)
        self.owned = set()  # ids of the variables this replica updates
        self.slots = set()  # ids of this replica's slot variables: its shard of the state

    def norm_sum(self, x):
        """`x` summed over the replicas (a squared norm: each holds its segment's)."""
        return self.collectives.sum(x)

    def owners(self):
        """{id(variable): replica} of the trainable variables (None: `Partition`'s own rule)."""
        return None

    def build(self, optimizer):
        """Partitions the trainable variables and builds `optimizer`'s slots of this replica's
        own (in `collectives.slot_scope()`), so that it updates only those."""
        c = self.collectives
        p = self.partition = Partition(self.trainables, c.size, self.owners())
        self.owned = {id(p.variables[i]) for i in p.of[c.rank]}
        if self.offload is not None:  # the slots in its store: none on the device
            optimizer.build([])
            self.offload.build(optimizer, [v for v in self.trainables if id(v) in self.owned])
            return
        with self._own_slots_only(optimizer):
            optimizer.build(self.trainables)

    @contextlib.contextmanager
    def _own_slots_only(self, optimizer):
        """Keras's optimizers create each slot with `add_variable_from_reference`; here it makes
        slots of this replica's variables only (None for the others', which Keras's optimizers
        skip, as for `overwrite_with_gradient`)."""
        optimizer.add_variable_from_reference = lambda v, name=None, initializer="zeros": \
            self.own_slot(optimizer, v, name, initializer)
        try:
            yield
        finally:
            del optimizer.add_variable_from_reference  # Keras's own again

    def own_slot(self, optimizer, variable, name, initializer="zeros"):
        if id(variable) not in self.owned or self.offload is not None:
            return None
        with self.collectives.slot_scope():
            slot = type(optimizer).add_variable_from_reference(
                optimizer, variable, name=name, initializer=initializer)
        self.slots.add(id(slot))
        return slot

    def update_gradients(self, grads_and_vars):
        """This replica's variables' gradients, summed over the replicas (a reduce-scatter)."""
        return self.reduce_scatter(grads_and_vars)

    def reduce_scatter(self, grads_and_vars):
        """[(summed gradient, variable)] of this replica's variables (those with a gradient)."""
        p, c = self.partition, self.collectives
        by_handle = {id(_handle(v)): g for g, v in grads_and_vars}
        grads = [by_handle.get(id(_handle(v))) for v in p.variables]
        dense = [tf.zeros(v.shape, tf.float32) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, p.variables)]
        buffer = tf.concat([p.flat(dense, r) for r in range(c.size)], 0)
        if "reduce_scatter" in self.skip:  # (the companion: this replica's gradients only)
            mine = buffer[c.rank * p.segment:(c.rank + 1) * p.segment]
        else:
            mine = c.reduce_scatter(buffer)
        return [(g, p.variables[i]) for i, g in p.unflat(mine, c.rank) if grads[i] is not None]

    def apply(self, optimizer, grads, variables):
        if self.offload is None:
            return optimizer.apply(grads, variables)
        for v, value in zip(variables, self.offload.apply(optimizer, grads, variables)):
            self.collectives.assign(v, value)

    def after_update(self):
        """Every replica's updated variables to every replica."""
        p, c = self.partition, self.collectives
        if "all_gather" in self.skip or c.size == 1:
            return
        every = c.all_gather(p.flat([_handle(v) for v in p.variables], c.rank))
        for r in range(c.size):
            if r != c.rank:
                for i, value in p.unflat(every[r * p.segment:(r + 1) * p.segment], r):
                    c.assign(p.variables[i], value)

    def common(self, variables):
        return [v for v in variables if id(v) not in self.slots]

    def describe(self):
        """One line: the stage, this replica's share and the partition's imbalance."""
        p, c = self.partition, self.collectives
        if p is None:
            return f"ZeRO-{self.stage} (not built yet)"
        return (f"ZeRO-{self.stage} over {c.size} replica(s): this replica owns "
                f"{len(p.of[c.rank])} of {len(p.variables)} variables ({p.loads[c.rank]:,} of "
                f"{sum(p.sizes):,} parameters); imbalance {p.imbalance:.2f}" + _offloaded(self))


class ShardedGradients(ShardedOptimizer):
    """ZeRO stage 2: stage 1, and the gradients that outlive a batch (the accumulated ones)
    sharded too: each batch's gradients are reduce-scattered at once, and each replica
    accumulates its own variables' only."""

    stage = 2

    def batch_gradients(self, grads_and_vars):
        return self.reduce_scatter(grads_and_vars)

    def update_gradients(self, grads_and_vars):
        return list(grads_and_vars)  # (reduced batch by batch)

    def accumulates(self, variable):
        return id(variable) in self.owned  # (its share, reduce-scattered batch by batch)


def _offloaded(stage):
    return f"; {stage.offload.describe()}" if stage.offload is not None else ""


def _handle(v):
    """The tf.Variable of a Keras variable."""
    return v.value if isinstance(v, keras.Variable) else v
