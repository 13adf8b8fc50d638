"""The whole optimizer of a sharded user model (ZeRO-1-3), for what Keras saves and restores:
`model.save`, `ModelCheckpoint`, `BackupAndRestore`.

Under ZeRO a replica's optimizer holds the slots (Adam's moments) of the variables it owns only,
so Keras, which saves `model.optimizer.variables` by position, would write one replica's shard
(the zeros of the others' slots load without a warning, since the counts can match). Instead,
while Keras's callbacks run (at the start of `fit`, at each epoch's end and after training:
`tfdist.strategies.keras_program`) the model shows a **whole** optimizer: a copy of the user's
optimizer (its config), built for every trainable variable, whose slots every replica
all-gathers from their owners (`WholeOptimizer.gather`, a collective). What Keras then saves is
what the same training without ZeRO would save, and what it restores (`BackupAndRestore`,
`load_weights`) lands in the whole optimizer, from which each replica takes back its own slots
(`give_back`) before the next batch.

Cost: every replica holds the whole optimizer state while it is shown (AdamW: twice the
parameters, float32), as ZeRO-3 holds the whole weights then; between the hooks only its share.
After `fit` it stays shown until the next `fit` starts, so that the chief alone may call
`model.save` (no collective in it).

An optimizer loaded whole (`keras.models.load_model` under the strategy) is sharded again at the
first `fit`: `copy_by_name` gives each replica's new optimizer its own slots' values.

Example (one replica: the whole optimizer holds the sharded one's slots):

    >>> import keras, numpy as np
    >>> from tfdist.parallel import zero
    >>> from tfdist.parallel.zero.whole import WholeOptimizer
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> sharded = zero.make(1, model, zero.local())
    >>> sharded.build(model_optimizer := keras.optimizers.Adam())
    >>> model_optimizer.apply([np.ones((2, 1), "float32"), np.ones(1, "float32")])
    >>> whole = WholeOptimizer(sharded, model_optimizer)
    >>> whole.gather()
    >>> len(whole.optimizer.variables), int(whole.optimizer.iterations)
    (6, 1)
"""
import numpy as np

from tfdist.errors import UsageError
from tfdist.runtime.lazy import tf


def copy_of(optimizer, variables, scope):
    """A new optimizer of `optimizer`'s class and config, built for `variables` in `scope` (this
    process's own variables), and {slot name: the variable it is a slot of}."""
    fresh = type(optimizer).from_config(optimizer.get_config())
    reference = {}
    make = fresh.add_variable_from_reference

    def recording(variable, name=None, initializer="zeros"):
        slot = make(variable, name=name, initializer=initializer)
        reference[slot.name] = variable
        return slot
    fresh.add_variable_from_reference = recording
    try:
        with scope():
            fresh.build(variables)
    finally:
        del fresh.add_variable_from_reference
    names = [v.name for v in fresh.variables]
    if len(set(names)) != len(names):
        raise UsageError(f"the optimizer {optimizer.name} has two variables of one name (two "
                         f"weights share a path); give the model's layers distinct names to "
                         f"save it under ZeRO")
    return fresh, reference


def _by_name(optimizer, sharded=None):
    """{name: variable} of `optimizer`'s, and (`sharded`'s offloaded) of the stored slots."""
    out = {v.name: v for v in optimizer.variables}
    offload = getattr(sharded, "offload", None)
    if offload is not None:
        out.update(offload.named_slots())
    return out


class WholeOptimizer:
    """The whole optimizer shown for `sharded`'s model (a `tfdist.parallel.zero` stage 1-3,
    built) in place of its `optimizer`, this replica's shard. `exchange`: the all-gather of an
    earlier one, to reuse."""

    def __init__(self, sharded, optimizer, exchange=None):
        self.sharded, self.shard, self.exchange = sharded, optimizer, exchange
        self.optimizer, self.reference = copy_of(optimizer, sharded.model.trainable_variables,
                                                 sharded.collectives.slot_scope)
        owner = _owners(sharded)
        mine = _by_name(optimizer, sharded)
        self.slots = [v for v in self.optimizer.variables if v.name in self.reference]
        self.owner = [owner[id(self.reference[s.name])] for s in self.slots]
        rank = sharded.collectives.rank
        missing = [s.name for s, r in zip(self.slots, self.owner)
                   if r == rank and s.name not in mine]
        if missing:
            raise UsageError(f"ZeRO: this replica's optimizer lacks the slot(s) {missing[:3]}")

    def gather(self):
        """Every slot from its owner, and the rest (the step, the learning rate) from this
        replica's optimizer: a collective (every replica calls it)."""
        c, mine = self.sharded.collectives, _by_name(self.shard, self.sharded)
        sizes = [int(np.prod(s.shape)) for s in self.slots]
        lengths = [sum(n for n, r in zip(sizes, self.owner) if r == q) for q in range(c.size)]
        longest = max(lengths + [1])
        if self.exchange is None:  # (one function per model: a retrace each time would warn)
            own = [mine[s.name] for s, r in zip(self.slots, self.owner) if r == c.rank]

            @tf.function
            def exchange():
                flat = [tf.reshape(tf.cast(_value(v), tf.float32), [-1]) for v in own]
                flat = tf.concat(flat + [tf.zeros([longest - lengths[c.rank]], tf.float32)], 0)
                # (a name per model: TF resolves a collective's shape once per key)
                name = f"tfdist_zero_whole_optimizer_{getattr(self.sharded, 'serial', 0)}"
                return c.all_gather(flat, name) if c.size > 1 else flat
            self.exchange = exchange
        every = self.exchange().numpy()
        start = [q * longest for q in range(c.size)]
        for s, n, r in zip(self.slots, sizes, self.owner):
            s.assign(every[start[r]:start[r] + n].reshape(s.shape).astype(s.dtype))
            start[r] += n
        for name, v in _by_name(self.optimizer).items():
            if name not in self.reference and name in mine:
                v.assign(_value(mine[name]))

    def give_back(self):
        """This replica's own slots, and the rest, from the whole optimizer (what a restore may
        have set): local."""
        copy_by_name(self.shard, self.optimizer, self.sharded)


def _value(v):
    """A variable's value, or an offloaded slot's (`tfdist.parallel.zero.offload.Offloaded`)."""
    return v.value() if callable(v.value) else v.value


def _owners(sharded):
    """{id(variable): replica} of the trainable variables (ZeRO-3's own map: its optimizer's
    partition holds only this replica's)."""
    if getattr(sharded, "owner", None):
        return sharded.owner
    p = sharded.partition
    return {id(p.variables[i]): r for r, indices in enumerate(p.of) for i in indices}


def copy_by_name(optimizer, source, sharded=None):
    """`optimizer`'s variables (a shard, built), each from `source`'s of its name (an optimizer
    built whole: the shown one, or a file's): its own slots, its step and its learning rate;
    and the slots `sharded`'s offload stores (`tfdist.parallel.zero.offload`); local."""
    source = _by_name(source)
    for v in optimizer.variables:
        if v.name in source:
            v.assign(source[v.name].value)
    offload = getattr(sharded, "offload", None)
    for name, stored in (offload.named_slots() if offload is not None else {}).items():
        if name in source:
            stored.restore(source[name].value)


class Shown:
    """`sharded`'s model shown whole to Keras (`show`: its weights, under ZeRO-3, and a
    `WholeOptimizer` as `model.optimizer`) or sharded again (`hide`). `optimizer`: the model's
    own, this replica's shard. While shown, the whole state is the truth: a `load_weights` then
    sets it, and `hide` gives each replica its share of it."""

    def __init__(self, sharded, optimizer):
        self.sharded, self.shard = sharded, optimizer
        self.whole = None
        self.exchange = None  # (the all-gather's function, once traced)

    def show(self):
        """A collective (every replica calls it); nothing when shown already."""
        self.sharded.materialize()
        if self.whole is None and self.shard is not None:
            self.whole = WholeOptimizer(self.sharded, self.shard, self.exchange)
            self.whole.gather()
            self.exchange = self.whole.exchange
            self.sharded.model.optimizer = self.whole.optimizer

    def hide(self):
        if self.whole is not None:
            self.whole.give_back()
            self.sharded.model.optimizer = self.shard
            self.whole = None
        if hasattr(self.sharded, "release"):
            self.sharded.release()
