"""ZeRO-Offload and ZeRO-Infinity (Ren et al. 2021, arXiv:2101.06840; Rajbhandari et al. 2021,
arXiv:2104.07857): a replica's optimizer state, and under ZeRO-3 its master weights, kept off
the device, in host memory or in files on a local disk (`tfdist.parallel.zero.store`), and the
optimizer's step run on the CPU, one sub-group at a time.

`--config.zero.offload=host|disk` (with ZeRO stage 1, 2 or 3), or
`tfdist.strategies.get(name, zero=3, offload="disk", offload_dir=...)` for a user's model.

The step (`Offload.step`, inside the training step's graph through `tf.py_function`):

* The replica's owned variables are cut, in order, into sub-groups of at most `subgroup`
  parameters (a larger variable is a sub-group of its own).
* Each sub-group has its own copy of the run's Keras optimizer (its class and config, its
  learning-rate schedule, the run's weight-decay exclusions), built on stand-in variables of the
  sub-group's shapes whose storage is empty between updates (`compat.make_stageable`). Its
  slots are empty too: their values live in the store.
* For sub-group k: its slots (and, ZeRO-3, its weights) are read from the store, which has read
  them ahead while k - 1 was updated; they fill the stand-ins; the copy's `apply` runs, on the
  CPU (tfdist's AdamW: one fused `ResourceApplyAdam` per variable), at the run's step count;
  the new values go back to the store in the background while k + 1 is updated; the stand-ins
  are emptied. So at most three sub-groups are in host memory at once: `buffer_bytes`.

Under ZeRO-3 the owned weights have no storage on the device either: a unit's call reads its
share from the store (`read_weights`); the store has read it ahead, in the order in which the
units were read during the first step (forward, then backward); the backward pass hands each
unit's reduce-scattered gradients to host memory (`push_gradients`), from which the update takes
them (`take_gradients`).

The same Keras optimizer arithmetic runs as without offload, so the losses are equal
(tests/test_offload.py). Backups see the store's values as variables (`Offloaded`), under the
names of the slots and weights they are, so a backup restores into a layout with or without
offload.

Example (one replica, a Dense layer, its Adam state on disk):

    >>> import keras, numpy as np, tempfile
    >>> from tfdist.parallel import zero
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> offload = zero.offload.Offload("disk", tempfile.mkdtemp())
    >>> sharded = zero.make(1, model, zero.local(), offload=offload)
    >>> optimizer = keras.optimizers.Adam(0.1)
    >>> sharded.build(optimizer)
    >>> grads = [(np.ones(v.shape, "float32"), v) for v in model.trainable_weights]
    >>> sharded.apply(optimizer, *zip(*sharded.update_gradients(grads)))
    >>> round(float(model.layers[0].bias.numpy()[0]), 4), int(optimizer.iterations.numpy())
    (-0.1, 1)
    >>> offload.close()
"""
import concurrent.futures
import dataclasses
import os
import statistics
import time

import numpy as np

from tfdist import compat
from tfdist.errors import UsageError
from tfdist.parallel.zero.partition import count
from tfdist.parallel.zero.store import Store
from tfdist.runtime.lazy import keras, tf

KINDS = ("none", "host", "disk")
#: Parameters per sub-group by default (DeepSpeed's `sub_group_size` is 1e9; a smaller one
#: bounds host memory on a small machine: 3 sub-groups of AdamW, weights and two moments).
SUBGROUP = 1 << 25


@dataclasses.dataclass
class Group:
    """A sub-group: `indices` into the offloaded variables; its `optimizer` (a copy of the run's)
    built on `standins`; `slots`: that optimizer's slot variables, each with its store key."""
    indices: list
    optimizer: object
    standins: list
    slots: list  # [(slot variable, store key)]

    @property
    def slot_keys(self):
        return [key for _, key in self.slots]


class Offload:
    """One replica's offload: `kind` "host" or "disk" (files under `directory`), sub-groups of at
    most `subgroup` parameters, reads ahead and writes behind unless `prefetch=False`."""

    def __init__(self, kind, directory=None, subgroup=SUBGROUP, prefetch=True):
        if kind not in ("host", "disk"):
            raise UsageError(f"zero.offload={kind!r}: choose one of {', '.join(KINDS)}")
        self.kind, self.subgroup, self.prefetch = kind, int(subgroup), prefetch
        self.store = Store(kind, directory, prefetch=prefetch)
        _return_freed_memory()
        self.variables = []  # the offloaded (owned) trainable variables, in order
        self.index = {}  # id(variable) -> its index
        self.groups = []
        self.master = False  # whether the weights are stored too (ZeRO-3)
        self.grads = {}  # index -> this update's summed gradient (host), ZeRO-3
        self.batches = 0  # batches whose gradients `grads` sums
        self._order, self._recorded, self._cursor = [], None, 0  # ZeRO-3's read order
        self.steps = 0
        self.io = []  # (bytes read, bytes written) of each update, the passes' reads since the last
        self.seconds = []  # the CPU step's seconds of each update
        self._mark = (0, 0)  # the store's counters at the last update's end
        self.names = {}  # the name the run's optimizer would give a slot -> its store key
        #: Called as f(update, sub-group) once a sub-group's writes have started (a fault
        #: test's: tools/faults/faulty_train.py --kill-in-offload).
        self.after_group = None

    # -- set up --------------------------------------------------------------------------------
    def keep_weights(self, variables):
        """Stores the values of `variables` (ZeRO-3's owned weights, before their storage is
        dropped): the master weights live in the store from now on."""
        self.master = True
        self._place(variables)
        for i, v in enumerate(self.variables):
            if compat.has_storage(v):
                self.store.put(_weight_key(i), np.asarray(v.numpy()))

    def build(self, optimizer, variables):
        """The sub-groups of `variables` (the owned trainable ones, in order), each with a copy
        of `optimizer` whose slots' initial values go to the store."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise UsageError("zero.offload cannot run with a loss-scaled optimizer "
                             "(mixed_float16); train in float32 or mixed_bfloat16")
        if getattr(optimizer, "global_clipnorm", None):
            raise UsageError("zero.offload steps each sub-group on its own, so the optimizer's "
                             "global_clipnorm would clip by a sub-group's norm; clip with "
                             "tfdist (train.grad_clip) or use clipnorm")
        self._place(variables)
        # The copies and their stand-ins are this process's own, stepped where no strategy is
        # entered (the step's py_function): made in a thread of their own, outside the
        # strategy's scope (under multi_worker_mirrored a variable made inside it would be
        # mirrored, initialised by a broadcast that the other workers, whose sub-groups differ,
        # never join).
        # (On the host's CPU: a GPU's memory is what offload frees; untested here.)
        def groups():
            with tf.device("CPU:0"):
                return [self._group(optimizer, indices) for indices in
                        _cut([count(v.shape) for v in self.variables], self.subgroup)]
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            self.groups = thread.submit(groups).result()

    def _place(self, variables):
        if not self.variables:
            self.variables = list(variables)
            self.index = {id(v): i for i, v in enumerate(self.variables)}
        elif [id(v) for v in variables] != [id(v) for v in self.variables]:
            raise ValueError("offload: the variables differ from those placed before")

    def _group(self, optimizer, indices):
        config = dict(optimizer.get_config(), learning_rate=0.0)
        schedule = compat.learning_rate_schedule(optimizer)
        copy = type(optimizer).from_config(config)
        if not isinstance(schedule, (int, float)) and callable(schedule):
            compat.set_learning_rate_schedule(copy, schedule)
        standins, excluded = [], []
        for i in indices:
            v = self.variables[i]
            s = keras.Variable(np.zeros(v.shape, v.dtype), dtype=v.dtype, name=v.name,
                               trainable=True)
            compat.make_stageable(s)
            standins.append(s)
            if not compat.uses_weight_decay(optimizer, v):
                excluded.append(s)
        if excluded:
            copy.exclude_from_weight_decay(var_list=excluded)
        own = {id(v) for v in copy.variables}  # (the step, the learning rate: no slots)
        make, reference = copy.add_variable_from_reference, {}

        def recording(variable, name=None, initializer="zeros"):
            slot = make(variable, name=name, initializer=initializer)
            reference[id(slot)] = variable
            return slot
        copy.add_variable_from_reference = recording
        try:
            copy.build(standins)
        finally:
            del copy.add_variable_from_reference
        slots = []
        by_standin = {id(s): i for i, s in zip(indices, standins)}
        for slot in copy.variables:
            if id(slot) in own:
                continue
            key = f"slot/{len(slots)}/{indices[0]}/{slot.name}"
            self.store.put(key, np.asarray(compat.storage(slot).numpy()))
            compat.make_stageable(slot)
            slots.append((slot, key))
            standin = reference.get(id(slot))
            if standin is not None:  # the name the run's own optimizer gives this slot
                real = self.variables[by_standin[id(standin)]]
                suffix = slot.name[len(standin.path.replace("/", "_")):]
                self.names[real.path.replace("/", "_") + suffix] = key
        return Group(list(indices), copy, standins, slots)

    # -- the step ------------------------------------------------------------------------------
    def step(self, iterations, learning_rate, grads, weights=None):
        """One update, eager (`apply`'s py_function): `grads` {index: gradient} (numpy or
        tensors) of the offloaded variables that have one; `weights` {index: value}, their
        current values (stages 1-2; ZeRO-3 reads its own). Returns {index: new value}
        (stages 1-2; ZeRO-3 stores them)."""
        start = time.perf_counter()
        self.store.drop_prefetched()  # (ZeRO-3's reads ahead: the weights are about to change)
        new, pending = {}, []
        groups = [g for g in self.groups if any(i in grads for i in g.indices)]
        if groups:
            self.store.prefetch(self._keys(groups[0]))
        for k, g in enumerate(groups):
            if k + 1 < len(groups):
                self.store.prefetch(self._keys(groups[k + 1]))
            values = self._update(g, int(iterations), learning_rate, grads, weights)
            self.store.wait(pending)  # (the one before k: at most one sub-group being written)
            pending = []
            for key, value in values.items():
                if isinstance(key, int):
                    new[key] = value
                else:
                    self.store.write_behind(key, value)
                    pending.append(key)
            if self.after_group is not None:
                self.after_group(self.steps + 1, k)
        self.store.flush()
        self.steps += 1
        self.seconds.append(time.perf_counter() - start)
        # per update: its own reads and writes, and the passes' reads since the one before
        read, written = self.store.bytes_read, self.store.bytes_written
        self.io.append((read - self._mark[0], written - self._mark[1]))
        self._mark = (read, written)
        if self.master and self._order:
            self._recorded, self._cursor = list(self._order), 0
            self.store.prefetch(self._weight_keys(self._recorded[0]))
        return new

    def _keys(self, group):
        keys = list(group.slot_keys)
        if self.master:
            keys += [_weight_key(i) for i in group.indices]
        return keys

    def _update(self, group, iterations, learning_rate, grads, weights):
        """Sub-group `group` updated: {store key or index: new value}."""
        present = [(i, s) for i, s in zip(group.indices, group.standins) if i in grads]
        for slot, key in group.slots:  # (a variable without a gradient: its slots unchanged)
            compat.fill_storage(slot, self.store.get(key))
        for i, s in present:
            compat.fill_storage(s, self.store.get(_weight_key(i)) if self.master else weights[i])
        opt = group.optimizer
        opt.iterations.assign(iterations)
        if learning_rate is not None:
            opt.learning_rate = learning_rate
        opt.apply([grads[i] for i, _ in present], [s for _, s in present])
        out = {key: compat.storage(slot).numpy() for slot, key in group.slots}
        for i, s in present:
            value = compat.storage(s).numpy()
            out[_weight_key(i) if self.master else i] = value
        for slot, _ in group.slots:
            compat.empty_storage(slot)
        for s in group.standins:
            compat.empty_storage(s)
        return out

    # -- in the training step's graph ----------------------------------------------------------
    def apply(self, optimizer, grads, variables):
        """The update of `variables` (offloaded ones) by `grads`, in the training step's graph;
        stages 1-2 assign the new values to the variables (`assign(variable, value)`: the
        replicas' collectives'), then the run's step count goes up."""
        indices = [self.index[id(v)] for v in variables]
        schedule = compat.learning_rate_schedule(optimizer)
        fixed = not callable(schedule) or isinstance(schedule, (int, float))
        rate = tf.cast(optimizer.learning_rate, tf.float32) if fixed else tf.constant(0.0)
        current = [] if self.master else [tf.convert_to_tensor(v) for v in variables]
        n = len(indices)

        def run(iterations, rate, *flat):
            new = self.step(iterations.numpy(), float(rate) if fixed else None,
                            dict(zip(indices, flat[:n])),
                            None if self.master else dict(zip(indices, flat[n:])))
            return [new[i] for i in indices] if not self.master else [np.float32(0)]
        out = tf.py_function(run, [optimizer.iterations, rate, *grads, *current],
                             [v.dtype for v in variables] if not self.master else [tf.float32])
        updates = []
        if not self.master:
            for v, value in zip(variables, out):
                value.set_shape(v.shape)
                updates.append(value)
        with tf.control_dependencies(out):
            optimizer.iterations.assign_add(1)
        return updates

    def read_weights(self, variables, record=True):
        """The stored values of `variables` (ZeRO-3's owned ones of a unit), in the graph.
        `record`: a read of the training step, in the order the store reads ahead."""
        indices = [self.index[id(v)] for v in variables]
        if not indices:
            return []

        def run():
            values = [self.store.get(_weight_key(i)) for i in indices]
            if record:
                self._read_order(indices)
            return values
        out = tf.py_function(run, [], [v.dtype for v in variables])
        for v, value in zip(variables, out):
            value.set_shape(v.shape)
        return out

    def _read_order(self, indices):
        """Records the first step's order of reads; in later steps, reads the next ahead."""
        if self._recorded is None:
            self._order.append(tuple(indices))
            return
        self._cursor += 1
        following = self._recorded[self._cursor] if self._cursor < len(self._recorded) else ()
        keys = self._weight_keys(following)
        self.store.drop_prefetched(keep=keys)  # (an evaluation's reads leave others unread)
        self.store.prefetch(keys)

    def _weight_keys(self, indices):
        return [_weight_key(i) for i in indices]

    def push_gradients(self, variables, grads):
        """Adds `grads` (ZeRO-3's reduce-scattered share of a unit) to this update's sums in
        host memory; returns a scalar 0 that the backward pass waits for."""
        indices = [self.index[id(v)] for v in variables]

        def run(*flat):
            for i, g in zip(indices, flat):
                g = np.asarray(g.numpy(), np.float32)
                if i in self.grads:  # (a weight read by two layers: the sum of both)
                    np.add(self.grads[i], g, out=self.grads[i])
                else:
                    self.grads[i] = np.array(g, copy=True)
            return np.float32(0)
        return tf.py_function(run, list(grads), tf.float32)

    def count_batch(self, after):
        """Counts a batch whose gradients were pushed (`after`: a tensor computed after them)."""
        def run(_):
            self.batches += 1
            return np.float32(0)
        return tf.py_function(run, [after], tf.float32)

    def take_gradients(self):
        """[(gradient, variable)] of this update, the mean over its batches, taken out of host
        memory (ZeRO-3): every owned variable's, as the resident ZeRO-3's reduce-scatter gives
        every unit variable one (zeros where it had none)."""
        order = list(range(len(self.variables)))

        def run():
            out, n = [], max(1, self.batches)
            self.batches = 0
            for i in order:
                g = self.grads.pop(i, None)
                out.append(tf.constant(g / n if n > 1 else g) if g is not None
                           else tf.zeros(self.variables[i].shape, tf.float32))
            return out
        values = tf.py_function(run, [], [tf.float32] * len(order))
        for v, value in zip(self.variables, values):
            value.set_shape(v.shape)
        return list(zip(values, self.variables))

    # -- the rest of tfdist --------------------------------------------------------------------
    def state(self):
        """{id(variable): Offloaded} of the offloaded slots (Keras's slot variables of the
        sub-group optimizers) and, ZeRO-3, of the weights (the model's variables)."""
        out = {}
        for g in self.groups:
            for slot, key in g.slots:
                out[id(slot)] = Offloaded(self.store, key)
        if self.master:
            for i, v in enumerate(self.variables):
                out[id(v)] = Offloaded(self.store, _weight_key(i))
        return out

    def named_slots(self):
        """{name: Offloaded} of the slots, under the names the run's own optimizer would give
        them (what `tfdist.parallel.zero.whole` matches by name)."""
        return {name: Offloaded(self.store, key) for name, key in self.names.items()}

    @property
    def stored_bytes(self):
        return self.store.nbytes

    @property
    def buffer_bytes(self):
        """Host memory the step holds at most beyond the store and the gradients: three
        sub-groups (one read ahead, one updated, one being written), each its state and weights
        up to four times (the buffer read, the stand-ins' TF copy, the updated value, the buffer
        written): `tfdist.parallel.memory`'s "buffers"."""
        largest = 0
        for g in self.groups:
            weights = sum(4 * count(self.variables[i].shape) for i in g.indices)
            largest = max(largest, weights + sum(self.store.nbytes_of(k) for k in g.slot_keys))
        return 3 * 4 * largest

    def describe(self):
        where = "host memory" if self.kind == "host" else f"files in {self.store.directory}"
        what = "optimizer state and master weights" if self.master else "optimizer state"
        return (f"offload: {what} in {where} ({self.stored_bytes / 2**20:,.1f} MiB), "
                f"{len(self.groups)} sub-group(s) of at most {self.subgroup:,} parameters, "
                f"{'prefetch on' if self.prefetch else 'prefetch off'}; host buffers up to "
                f"{self.buffer_bytes / 2**20:,.1f} MiB")

    def summary(self):
        """One line: the updates' medians of bytes read and written, and of the CPU step."""
        if not self.io[1:]:
            return "offload: fewer than 2 updates (no steady figures)"
        steady = self.io[1:]  # (the first update's reads include the initial ones)
        read = statistics.median(r for r, _ in steady)
        written = statistics.median(w for _, w in steady)
        return (f"offload: per update (median of {len(steady)}), {read / 2**30:,.2f} GiB read and "
                f"{written / 2**30:,.2f} GiB written ({self.kind}); the CPU step "
                f"{statistics.median(self.seconds[1:]):,.2f} s")

    def close(self):
        self.store.close()


def _return_freed_memory():
    """Large allocations through mmap from now on, so that what the step frees goes back to the
    system: glibc's threshold otherwise rises to the largest block freed (up to 32 MiB) and serves
    the step's many 1-40 MiB tensors and arrays from arenas that keep the freed memory (measured,
    GPT-2 medium with ZeRO-3 and disk offload: peak RSS 6,047 -> 5,217 MiB, its step 10 % slower;
    the same as MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_ARENA_MAX=2). Not glibc: nothing."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB, fixed (no dynamic threshold)
        libc.mallopt(-8, 2)  # M_ARENA_MAX: 2
    except (OSError, AttributeError):
        pass


def _weight_key(i):
    return f"weight/{i}"


def _cut(sizes, bound):
    """Consecutive runs of `sizes`' indices, each of at most `bound` in sum (or one item)."""
    runs, run, total = [], [], 0
    for i, n in enumerate(sizes):
        if run and total + n > bound:
            runs.append(run)
            run, total = [], 0
        run.append(i)
        total += n
    return runs + ([run] if run else [])


class Offloaded(compat.Tensors):
    """A stored value shown to `tf.train.Checkpoint` as a variable's: a backup reads it from the
    store and a restore writes it there."""

    def __init__(self, store, key):
        super().__init__()
        self.store, self.key = store, key

    def value(self):
        shape, dtype = self.store.shape(self.key), self.store.dtype(self.key)
        out = tf.py_function(lambda: self.store.get(self.key), [], tf.as_dtype(dtype))
        out.set_shape(shape)
        return out

    def restore(self, tensor):
        self.store.put(self.key, np.asarray(tensor.numpy(), self.store.dtype(self.key)))
        return tf.no_op()


def directory(base, rank):
    """The store's directory of replica `rank` under zero.offload_dir `base`."""
    return os.path.join(base, f"rank-{rank}")
