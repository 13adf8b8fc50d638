"""ZeRO stage 3 (Rajbhandari et al. 2020; PyTorch's FSDP): the weights themselves sharded over the
N data-parallel replicas, for tfdist's GPT and for any Keras model (docs/parallelism.md, ZeRO-3).

Storage: whole variables, as stages 1-2 shard the optimizer state: each trainable variable has
one owner, which alone keeps its storage; elsewhere the Keras variable stays (shape, name, place
in the model) without a value (`compat.release_storage`). A "unit", what is gathered at once, is
a top-level layer with weights (a GPT block); its variables are partitioned on their own, so that
each gather's shares are close (`tfdist.parallel.zero.partition`). A weight read outside any unit
(the GPT's head, tied to the token embedding) is gathered where it is read.

For each batch, a unit's call all-gathers its weights and runs the layer's own `call` with them
substituted (`Gathering`, a `keras.StatelessScope`); they die when it returns. Its backward
(`tf.custom_gradient`) gathers them again, recomputes the unit's forward (its dropout masks and
norm statistics as in the forward) and reduce-scatters the weights' gradients to their owners.
The optimizer updates the owned weights only. So a replica holds 1/N of the weights plus at most
two units' gathered weights: the next unit's gather may start when the current one starts
(prefetch). `regather=False` keeps the forward's gathered weights for backward instead.

Example (one replica: the sharded model computes what the plain one does):

    >>> import keras, numpy as np, tensorflow as tf
    >>> from tfdist.parallel import zero
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    >>> x = np.ones((2, 4), "float32")
    >>> before = model(x)
    >>> sharded = zero.make(3, model, zero.local())
    >>> bool(np.allclose(model(x), before))
    True
    >>> print(sharded.describe())  # doctest: +NORMALIZE_WHITESPACE
    ZeRO-3 over 1 replica(s): this replica holds 2 of 2 units, 4 of 4 variables (23 of 23
    parameters); largest unit 15 parameters; imbalance 1.00
"""
import contextlib
import functools
import itertools
import threading

from tfdist import compat
from tfdist.errors import UsageError
from tfdist.parallel.zero.optimizer import ShardedGradients
from tfdist.parallel.zero.partition import Partition, count, owners
from tfdist.runtime.lazy import keras, tf

_SERIAL = itertools.count()  # each sharded model's number in this process (the same everywhere)


class Unit:
    """What is gathered at once: a layer's trainable variables (`layer` None: the model's own);
    `partition` (a `tfdist.parallel.zero.partition.Partition`, set by `ShardedWeights`): which
    replica owns each, and the flat layout of the unit's collectives."""

    def __init__(self, index, layer, variables):
        self.index = index
        self.layer = layer
        self.variables = variables
        self.sizes = [count(v.shape) for v in variables]
        self.partition = None
        # The first of its variables' devices: a pipeline stage's (tensor-parallel shards: the
        # stage's first device), which orders its gathers (`ShardedWeights._after`).
        self.device = min(str(getattr(v.value, "device", "") or "") for v in variables)

    @property
    def parameters(self):
        return sum(self.sizes)


def units_of(model, nested=True):
    """The model's units: the layers with trainable variables, in call order as Keras lists them,
    each once (a layer called twice, or listed by two models, is one unit), then (when some are
    left) the model's own variables. A nested model (a keras-hub task's backbone, tfdist's
    `Pipeline` of a GPT) is not a unit: its layers are. A unit's layer may hold another unit's
    layer (a weight shared by two layers): its gather then holds that layer's weights too, and
    the inner layer runs with them (`_unit_call`). `nested=False`: the model's own layers only,
    each a unit, nested models too (the rule before, a companion test's: keras-hub's GPT-2 fails
    under it)."""
    layers, seen = [], set()

    def visit(container):
        for layer in container.layers:
            if id(layer) in seen or not layer.trainable_variables:
                continue
            seen.add(id(layer))
            if isinstance(layer, keras.Model) and nested:
                visit(layer)
            else:
                layers.append(layer)
    visit(model)
    units = []
    placed = set()  # ids of the variables in a unit
    for layer in layers:
        variables = list(layer.trainable_variables)
        units.append(Unit(len(units), layer, variables))
        placed |= {id(v) for v in variables}
    rest = [v for v in model.trainable_variables if id(v) not in placed]
    if rest:
        units.append(Unit(len(units), None, rest))
    return units


class ShardedWeights(ShardedGradients):
    """ZeRO stage 3 of the built `model` over `collectives`' replicas: stage 2, and each weight
    stored by its owner only (`make(3, ...)` shards it; call it before the optimizer's slots are
    built, as tfdist's step does). `owned`: the variables this replica holds; `sources()`: what
    the step differentiates the loss by (the owned variables, then an anchor that puts every
    unit's backward on each replica's path). `skip`: collectives to leave out, "all_gather" (each
    replica computes with zeros for what it does not own) or "reduce_scatter" (each owner updates
    with its own replica's gradient only), a companion test's; `regather=False` keeps the
    forward's gathered weights for the backward pass; `nested=False`: the units and calls of
    before (`units_of`), for a companion test."""

    stage = 3

    def __init__(self, model, collectives, skip=(), regather=True, nested=True, offload=None):
        super().__init__(model, collectives, skip, offload=offload)
        if offload is not None and not regather:
            raise UsageError("ZeRO-3 with zero.offload gathers each unit again in its backward "
                             "pass (regather=True): the forward's weights are not kept")
        c = collectives
        self.regather = regather
        self.nested = nested
        self.units = units_of(model, nested)
        self.owner = {}  # id(variable) -> replica
        self.home = {}  # id(variable) -> (unit, position)
        self.load = [0] * c.size
        for unit in self.units:  # each variable partitioned in its first unit, balanced
            for i, v in enumerate(unit.variables):
                self.home.setdefault(id(v), (unit.index, i))
            fresh = [v for v in unit.variables if id(v) not in self.owner]
            self.owner.update(owners(fresh, c.size, self.load))
            unit.partition = Partition(unit.variables, c.size, self.owner)
        variables = [v for u in self.units for v in u.variables]
        self.variables = list({id(v): v for v in variables}.values())
        self.owned_variables = [v for v in self.variables if self.owner[id(v)] == c.rank]
        missing = [v.path for v in model.trainable_variables if id(v) not in self.owner]
        if missing:
            raise UsageError(f"ZeRO-3 cannot place the weight(s) {missing[:3]}; they belong to "
                             f"no layer")
        # Holds 0, never updated: each unit's collectives take it as an input (the pad of a share
        # is filled from it), so that every unit's backward is on the path to it (`sources`).
        self.anchor = tf.Variable(0.0, name="tfdist_zero3_anchor")
        self.sink = tf.Variable(0.0, trainable=False, name="tfdist_zero3_sink")
        self._last = {}  # (graph, device) -> what the next gather there waits for (prefetch)
        self._names = (None, {})  # (graph, {(tag, unit): collectives named so far})
        # Part of every collective's name: TF's collectives resolve an instance's shape once per
        # key, so a second model's gathers need keys of their own (measured: "Shape mismatch in
        # the collective instance" under multi_worker_mirrored when they reused the first's).
        self.serial = next(_SERIAL)
        self._gather_all = None  # (full_values' function)

    # -- the stage's interface (tfdist.parallel.zero.stage) ------------------------------------
    @property
    def trainables(self):
        return self.owned_variables

    def owners(self):
        return self.owner

    def sources(self):
        if self.offload is not None:  # (the owned gradients go to host memory in backward)
            return [self.anchor]
        return self.owned_variables + [self.anchor]

    def batch_gradients(self, grads_and_vars):
        """The owned weights' gradients, which the backward pass reduce-scattered already. The
        anchor's gradient (0) is stored, so that TF runs what it depends on: every unit's
        reduce-scatter. (Horovod's ops are not marked stateful: a replica that needs none of a
        unit's gradients would prune that unit's collective, and the others would wait for
        it.)"""
        grads_and_vars = list(grads_and_vars)
        anchor_gradient, _ = grads_and_vars[-1]
        self.sink.assign(anchor_gradient)
        if self.offload is not None:  # (the batch's gradients are in host memory)
            self.offload.count_batch(anchor_gradient)
        return [(g, v) for g, v in grads_and_vars[:-1] if g is not None and id(v) in self.owned]

    def update_gradients(self, grads_and_vars):
        if self.offload is not None:  # the mean of the batches' gradients, from host memory
            return self.offload.take_gradients()
        return super().update_gradients(grads_and_vars)

    def after_update(self):
        """Nothing: the weights are gathered where they are used."""

    def common(self, variables):
        return [v for v in super().common(variables) if id(v) not in self.owner]

    # -- storage -------------------------------------------------------------------------------
    def release(self):
        """Drops the storage of every variable another replica owns (offloaded: of every
        variable; the owned ones' values go to the offload's store first)."""
        if self.offload is not None:
            self.offload.keep_weights(self.owned_variables)
        for v in self.variables:
            if self.owner[id(v)] != self.collectives.rank:
                compat.release_storage(v)
            elif self.offload is not None:
                compat.release_storage(v, f"the weight {v.path} is offloaded (zero.offload): "
                                          f"read it after `materialize()`")

    def full_values(self):
        """The model's weights (`model.weights`' order), whole, as numpy arrays: a collective
        (every replica calls it); nothing is stored."""
        if self._gather_all is None:  # (traced once: a retrace at each call would warn)
            @tf.function
            def gather_all():
                # One unit after another: two units of which this replica holds nothing gather
                # the same input (the pad), and grappler would merge the two unordered gathers
                # into one (Horovod's ops are not stateful), which the other replicas never meet.
                pad, out = self.anchor.read_value(), []
                for u in self.units:
                    with tf.control_dependencies(out[-1][:1] if out else []):
                        out.append(self._gathered(u, self._mine(u, record=False), "all", pad))
                return out
            self._gather_all = gather_all
        full = {}
        for unit, values in zip(self.units, self._gather_all()):
            full.update({id(v): value for v, value in zip(unit.variables, values)})
        return [full[id(w)].numpy() if id(w) in full else w.numpy() for w in self.model.weights]

    def materialize(self):
        """Every variable full again on every replica (a collective: all call it): to save the
        whole model, or to read its weights. `release()` shards them again."""
        # Variables of this process: within a strategy's scope (a user's fit), not mirrored ones
        # (multi_worker_mirrored would broadcast them from worker 0, which holds other ones).
        scope = (compat.local_variables(tf.distribute.get_strategy())
                 if tf.distribute.has_strategy() else contextlib.nullcontext())
        with scope:
            for w, value in zip(self.model.weights, self.full_values()):
                if not compat.has_storage(w):
                    compat.restore_storage(w, value)

    def held_parameters(self):
        """Parameters this replica stores, counted from its variables."""
        return sum(count(v.shape) for v in self.variables if compat.has_storage(v))

    def describe(self):
        c = self.collectives
        held = [u for u in self.units if any(self.owner[id(v)] == c.rank for v in u.variables)]
        return (f"ZeRO-3 over {c.size} replica(s): this replica holds {len(held)} of "
                f"{len(self.units)} units, {len(self.owned_variables)} of {len(self.variables)} "
                f"variables ({self.load[c.rank]:,} of {sum(self.load):,} parameters); largest "
                f"unit {self.largest_unit:,} parameters; imbalance {self.imbalance:.2f}"
                + (f"; {self.offload.describe()}" if self.offload is not None else ""))

    @property
    def largest_unit(self):
        return max(u.parameters for u in self.units)

    @property
    def imbalance(self):
        """The largest replica's share over the mean."""
        return max(self.load) / max(1.0, sum(self.load) / len(self.load))

    # -- the collectives -----------------------------------------------------------------------
    def _owned(self, unit):
        return [unit.variables[i] for i in unit.partition.of[self.collectives.rank]]

    def _mine(self, unit, record=True):
        """This replica's variables of `unit`, read from their storage (not Keras's scope), or
        from the offload's store (`record`: a read of the step, whose order it learns)."""
        if self.offload is not None:
            return self.offload.read_weights(self._owned(unit), record)
        return [tf.convert_to_tensor(compat.storage(v)) for v in self._owned(unit)]

    def _to_owners(self, unit, d_mine, d_anchor, pad):
        """The owned share of a unit's gradients: returned, or under offload handed to host
        memory (the anchor's gradient then waits for it)."""
        if self.offload is None:
            return d_mine, d_anchor
        token = self.offload.push_gradients(self._owned(unit), d_mine)
        return [None] * len(d_mine), d_anchor + token * pad

    def _gathered(self, unit, mine, tag, pad):
        """Every variable of `unit`, full: this replica's `mine` and the others' all-gathered.
        Each share is padded with `pad`, the anchor's value (0), a runtime tensor: Horovod's
        collectives are not marked stateful, so TF's grappler would compute a gather of
        constants (a replica's share that is all padding) while it optimizes the graph, on that
        replica alone."""
        p, c = unit.partition, self.collectives
        tensors = dict(zip(p.of[c.rank], mine))
        if c.size == 1:  # one replica: its share is the unit (no flat buffer, no copies)
            return [tf.convert_to_tensor(tensors[i]) for i in range(len(unit.variables))]
        # (ragged: unpadded shares, each ending with the anchor's value, so that none is empty)
        flat = p.flat(tensors, c.rank, pad, ragged=c.ragged)
        lengths = [p.length(r, c.ragged) for r in range(c.size)]
        every = None
        if c.size > 1 and "all_gather" not in self.skip:
            every = c.all_gather(flat, self._name(tag, unit))
        out, start = [None] * len(unit.variables), 0
        for r in range(c.size):
            if every is not None:
                share = every[start:start + lengths[r]]
            else:  # (all_gather skipped: zeros for the others' weights)
                share = flat if r == c.rank else tf.zeros([lengths[r]], tf.float32)
            start += lengths[r]
            for i, value in p.unflat(share, r):
                out[i] = value
        return out

    def _reduce_scatter(self, unit, grads, tag, pad):
        """This replica's share of `grads` (one per variable of `unit`), summed over replicas."""
        p, c = unit.partition, self.collectives
        dense = [tf.fill(v.shape, pad) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, unit.variables)]
        if c.size == 1:  # one replica: its share is the unit's gradients as they are
            mine = [tf.cast(dense[i], unit.variables[i].dtype) for i in p.of[0]]
            return mine, tf.reduce_sum(tf.reshape(mine[0], [-1])[:1]) * pad
        buffer = tf.concat([p.flat(dense, r, pad) for r in range(c.size)], 0)
        if c.size > 1 and "reduce_scatter" not in self.skip:
            mine = c.reduce_scatter(buffer, self._name(tag, unit))
        else:
            mine = buffer[c.rank * p.segment:(c.rank + 1) * p.segment]
        # The anchor's gradient: 0, computed from the collective so that it waits for it (times the
        # anchor's value: grappler folds a product by the constant 0 away, and the dependency too).
        return [value for _, value in p.unflat(mine, c.rank)], tf.reduce_sum(mine[:1]) * pad

    def _after(self, unit, tensors):
        """A control dependency on the input of the last unit on `unit`'s device (its pipeline
        stage), in this graph: the prefetch bound. (Per stage: a chain through all stages would
        keep stage 0 from starting a microbatch while stage 1 runs the one before.)"""
        graph = tf.compat.v1.get_default_graph()
        self._last = {k: v for k, v in self._last.items() if k[0] is graph}
        last = self._last.get((graph, unit.device))
        self._last[graph, unit.device] = [t for t in tensors if t is not None]
        return tf.control_dependencies(last) if last else contextlib.nullcontext()

    def _name(self, tag, unit):
        """The collective's name: the same on every replica, unique in its graph."""
        graph = tf.compat.v1.get_default_graph()
        if self._names[0] is not graph:
            self._names = (graph, {})
        key = (tag, unit.index)
        n = self._names[1][key] = self._names[1].get(key, -1) + 1
        return f"tfdist_zero3_{self.serial}_{tag}_{unit.index}_{n}"

    def gather(self, unit):
        """`unit`'s full weights, differentiable: their gradient is reduce-scattered to the
        owners (what a read outside the unit's own call uses)."""
        mine = self._mine(unit)

        @tf.custom_gradient
        def gather(anchor, *mine):
            full = self._gathered(unit, list(mine), "read", anchor)

            def grad(*d_full):
                d_mine, d_anchor = self._to_owners(unit, *self._reduce_scatter(
                    unit, list(d_full), "read_grad", anchor), anchor)
                return [d_anchor] + d_mine
            return full, grad
        return list(gather(self.anchor.read_value(), *mine))

    # -- the calls -----------------------------------------------------------------------------
    def wrap(self):
        """Each unit's layer computes with its gathered weights; the model's own call (and a
        pipeline's `compute_gradients`, whose 1F1B schedule runs the stages without it) gathers
        what it reads outside them."""
        for unit in self.units:
            if unit.layer is not None:
                unit.layer.call = self._unit_call(unit, unit.layer.call)
        self.model.call = self._model_call(self.model.call)
        # (its backward may recompute a stage under a gradient tape of its own: what it reads
        # must be gathered there, not reused)
        if hasattr(self.model, "compute_gradients"):
            self.model.compute_gradients = self._model_call(self.model.compute_gradients,
                                                            reuse=False)

    def _model_call(self, call, reuse=True):
        @functools.wraps(call)
        def model_call(*args, **kwargs):
            with Gathering(self, reuse=reuse) as scope:
                out = call(*args, **kwargs)
            scope.apply_updates()
            return out
        return model_call

    def _inside_gather(self, unit):
        """Whether `unit`'s layer runs inside another unit's call whose gathered weights hold its
        own (a layer that holds it). Its call then reads them there: a gather of its own would
        read variables inside that unit's `tf.custom_gradient`, which TF refuses ("grad_fn must
        accept keyword argument 'variables'"), and the outer unit's backward already
        differentiates through it."""
        scopes = getattr(Gathering.entered, "scopes", None)
        if not scopes or not self.nested:
            return False
        given = scopes[-1].state_mapping
        return all(id(v) in given for v in unit.variables)

    def _unit_call(self, unit, call):
        layer = unit.layer

        @functools.wraps(call)
        def unit_call(inputs, *args, **kwargs):
            if self._inside_gather(unit):  # run by a unit whose gather holds its weights
                return call(inputs, *args, **kwargs)
            flat_in = tf.nest.flatten(inputs)
            n_in = len(flat_in)
            state = [(v, tf.convert_to_tensor(v.value)) for v in layer.non_trainable_variables]
            structure = []

            def run(ins, full):
                mapping = list(zip(unit.variables, full)) + state
                with Gathering(self, mapping) as scope:
                    out = call(tf.nest.pack_sequence_as(inputs, list(ins)), *args, **kwargs)
                return out, scope

            mine, anchor = self._mine(unit), self.anchor.read_value()

            if not self.regather:  # kept: a differentiable gather, held until its backward
                with self._after(unit, flat_in):
                    out, scope = run(flat_in, self.gather(unit))
                scope.apply_updates()
                return out

            @tf.custom_gradient
            def block(*flat):
                ins, pad, mine_ = flat[:n_in], flat[n_in], list(flat[n_in + 1:])
                with self._after(unit, flat_in):
                    full = self._gathered(unit, mine_, "fwd", pad)
                out, scope = run(ins, full)
                structure.append(out)
                updates = [(v, scope.updated[id(v)]) for v, _ in state if id(v) in scope.updated]

                def grad(*d_out):
                    with self._after(unit, list(d_out)):  # (offloaded: read again from the store)
                        again = self._mine(unit) if self.offload is not None else mine_
                        full = self._gathered(unit, again, "bwd", pad)
                    with tf.GradientTape() as tape:
                        watched = [x for x in ins if x.dtype.is_floating] + full
                        tape.watch(watched)
                        again, _ = run(ins, full)
                    grads = tape.gradient(tf.nest.flatten(again), list(ins) + full,
                                          output_gradients=list(d_out),
                                          unconnected_gradients=tf.UnconnectedGradients.NONE)
                    d_mine, d_anchor = self._to_owners(unit, *self._reduce_scatter(
                        unit, grads[n_in:], "grad", pad), pad)
                    d_ins = [g if x.dtype.is_floating else None for g, x in zip(grads[:n_in], ins)]
                    return d_ins + [d_anchor] + d_mine
                # Norm statistics, RNG states: applied (or recorded by the model's scope, which
                # applies them).
                for v, value in updates:
                    v.assign(value)
                return tf.nest.flatten(out), grad

            flat_out = block(*flat_in, anchor, *mine)
            return tf.nest.pack_sequence_as(structure[-1], list(tf.nest.flatten(flat_out)))
        return unit_call


class Gathering(keras.StatelessScope):
    """The scope in which a sharded model's layers run: a Keras stateless scope whose variables'
    values are given (`mapping`: a unit's gathered weights), and in which a sharded weight that
    `mapping` does not give is gathered where it is read (`ShardedWeights.gather`: once per unit
    and scope; each time it is read, with `reuse=False`). Assignments are recorded (`updated`)
    for `apply_updates` to make after it. A value it lacks is looked up in the Gathering scope
    it is inside.

    Example (one replica: a weight read in the scope is its gathered value):

        >>> import keras, numpy as np
        >>> from tfdist.parallel import zero
        >>> from tfdist.parallel.zero.weights import Gathering
        >>> model = keras.Sequential([keras.Input((2,)),
        ...                           keras.layers.Dense(1, kernel_initializer="ones")])
        >>> sharded = zero.make(3, model, zero.local())
        >>> with Gathering(sharded):
        ...     float(np.sum(model.layers[0].kernel))
        2.0
    """

    entered = threading.local()  # .scopes: the Gathering scopes this thread entered, innermost last

    def __init__(self, sharded, mapping=None, reuse=True):
        super().__init__(mapping or [], initialize_variables=False)
        self.sharded = sharded
        self.reuse = reuse
        self.updated = {}  # id(variable) -> the value assigned in the scope
        self._variables = {}  # id(variable) -> the variable
        self._read = {}  # unit index -> its gathered weights
        self.parent = None

    def __enter__(self):
        scopes = Gathering.entered.__dict__.setdefault("scopes", [])
        self.parent = scopes[-1] if scopes else None
        scopes.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        Gathering.entered.scopes.remove(self)
        return super().__exit__(*exc)

    def add_update(self, update):
        variable, value = update
        super().add_update(update)
        self.updated[id(variable)] = value
        self._variables[id(variable)] = variable

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        home = self.sharded.home.get(id(variable))
        if value is None and home is not None:
            u, i = home
            if u not in self._read or not self.reuse:
                self._read[u] = self.sharded.gather(self.sharded.units[u])
            value = self._read[u][i]
        # updated in the enclosing scope (an RNG state, by a microbatch before)
        if value is None and self.parent is not None:
            value = self.parent.get_current_value(variable)
        return value

    def apply_updates(self):
        for key, value in self.updated.items():
            self._variables[key].assign(value)
