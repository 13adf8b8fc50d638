"""A user's own Keras program under a strategy plugin: `model.compile(...)` inside the plugin's
`scope()` hands the model to the plugin, and from then on Keras's `compile`, `fit`, `evaluate`,
`predict` and `save` go through `keras_call` (one mechanism for every strategy:
`tfdist.compat.route_keras`). The plugin adds its gradient handling to the compiled optimizer
(also an optimizer given as a string), its callbacks, its split of plain datasets, and lets only
the chief write files. `Strategy` (tfdist.strategies.base) is a `KerasProgram`; a plugin overrides
what its strategy does differently (Horovod: the split; the parameter server: its coordinator).

Example (a model compiled in a plugin's scope is that plugin's):

    >>> import keras, tfdist.strategies
    >>> from tfdist.strategies.keras_program import owner_of
    >>> strategy = tfdist.strategies.get("mirrored", devices=2)
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> owner_of(model) is strategy
    True
"""
import contextlib
import importlib
import itertools
import os
import shutil
import sys
import tempfile
import threading
import weakref

from tfdist.errors import UsageError
from tfdist.runtime.lazy import keras, tf

_ACTIVE = threading.local()  # .stack: the plugins whose scope() is entered, innermost last
_OWNERS = weakref.WeakKeyDictionary()  # model -> the plugin it was compiled under
_BY_TF_STRATEGY = weakref.WeakValueDictionary()  # id(tf.distribute strategy) -> plugin
_PROCESS_WIDE = []  # a plugin that owns every model of its process (Horovod)
_OFFLOADS = itertools.count()  # (each offloaded model's store its own directory)
_SHARDED = weakref.WeakSet()  # models compiled in the scope of a plugin with user_zero (ZeRO-3)
_CHECKED = weakref.WeakSet()  # models whose non-finite updates tfdist's step skips
_AUTO = weakref.WeakSet()  # models compiled in the scope of `get("auto")`, not yet measured
_AUTO_OFFLOAD = weakref.WeakKeyDictionary()  # model -> (kind, directory) that auto chose
_REBATCHED = weakref.WeakKeyDictionary()  # model -> the pieces auto splits each fit's batches into
_ZERO_STAGE = weakref.WeakKeyDictionary()  # model -> ZeRO-1 or 2, where auto chose it
_ACCUMULATING = weakref.WeakKeyDictionary()  # model -> its optimizer's accumulation steps, where
#                                             tfdist's step accumulates them (not Keras)


def owner_of(model, compiling=False):
    """The plugin that owns `model`. At `compile`: the plugin whose scope is active, else the one
    whose tf.distribute strategy the model was built under, else a process-wide plugin; the
    model then stays its plugin's."""
    if not compiling:
        return _OWNERS.get(model)
    stack = getattr(_ACTIVE, "stack", [])
    plugin = (stack[-1] if stack else _BY_TF_STRATEGY.get(id(model.distribute_strategy))
              or (_PROCESS_WIDE[-1] if _PROCESS_WIDE else None))
    if plugin is not None:
        _OWNERS[model] = plugin
    return plugin


class KerasProgram:
    """How a plugin runs a user's compiled model (the methods `tfdist.compat.route_keras` calls)."""

    def adopt_keras_models(self):
        """From now on a model compiled in this plugin's scope (or built under its tf.distribute
        strategy; a process-wide plugin: any) is this plugin's, and Keras's methods route here."""
        if self.tf_strategy is not tf.distribute.get_strategy():  # not TF's default strategy
            _BY_TF_STRATEGY[id(self.tf_strategy)] = self
        if self.process_wide:
            _PROCESS_WIDE.append(self)
        from tfdist import compat
        compat.route_keras(owner_of)

    @contextlib.contextmanager
    def entered(self):
        """This plugin's scope is the innermost entered (for `owner_of`)."""
        stack = _ACTIVE.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            yield
        finally:
            stack.remove(self)

    # -- a user's Keras program (compat.route_keras) ------------------------------------------
    def before_compile(self, model, arguments):
        """An optimizer built before the scope was entered belongs to another tf.distribute
        strategy (TF: "Mixing different tf.distribute.Strategy objects"): it is rebuilt from its
        config in this scope, or refused when it already holds state. A model on Keras's mesh
        (`tfdist.parallel.mesh`) is refused: the mesh is its strategy."""
        from tfdist import compat
        if "tfdist.parallel.mesh" in sys.modules and sys.modules["tfdist.parallel.mesh"].enabled():
            from tfdist.parallel import mesh
            if mesh.model_on_mesh(model):
                raise UsageError(
                    f"the model is on keras.distribution's mesh (its variables laid out by "
                    f"{type(compat.current_distribution()).__name__}), and is compiled under "
                    f"tfdist's strategy {self.name}{' with ZeRO-3' if self.user_zero else ''}: "
                    f"the two do not compose. The mesh is the strategy: its batch axis is the "
                    f"data parallelism, and a layout over it (keras-hub's maps shard kernels "
                    f"over 'batch' too) shards the weights as ZeRO-3 would; compile the model "
                    f"outside the strategy's scope")
        optimizer = arguments.get("optimizer")
        if (not isinstance(optimizer, keras.optimizers.Optimizer)
                or compat.optimizer_strategy(optimizer) is tf.distribute.get_strategy()):
            return
        if optimizer.built or int(optimizer.iterations.numpy()):
            raise UsageError(f"the optimizer {optimizer.name} was built outside "
                             f"strategy.scope() and has state already; create it inside the scope")
        arguments["optimizer"] = type(optimizer).from_config(optimizer.get_config())
        print(f"tfdist: optimizer {optimizer.name} was created outside strategy.scope(); rebuilt "
              f"from its config inside it", file=sys.stderr, flush=True)

    #: ZeRO stage of a user's compiled models (`tfdist.strategies.get(name, zero=3)`); 0: none.
    user_zero = 0
    #: ZeRO-Offload of their state (`get(name, zero=3, offload="host"|"disk", offload_dir=D)`):
    #: (kind, directory), or None.
    user_offload = None
    #: K > 0: a user's model compiled in the scope skips updates whose loss or gradients are
    #: not finite (`tfdist.strategies.get(name, skip_nonfinite=K)`, `tfdist.runtime.nonfinite`)
    user_skip_nonfinite = 0
    #: `get("auto", memory_gb=G)`: G (0: this host's share), and a model compiled in the scope is
    #: measured at its first fit and sharded or offloaded as it needs (tfdist.parallel.budget);
    #: None: as named.
    user_auto = None
    #: Whether `zero=3` may shard a user's model here (one replica per process: horovod,
    #: multi_worker_mirrored).
    shards_user_models = False

    #: Keras 3's own `gradient_accumulation_steps` runs here. Under the tf.distribute strategies
    #: of several replicas its applying step, inside a cond, calls merge_call, which TF refuses
    #: there (keras-team/keras#20582): a user's model whose optimizer accumulates takes tfdist's
    #: step instead (`stepped`).
    runs_keras_accumulation = False

    def after_compile(self, model):
        """The strategy's gradient handling on the compiled optimizer (once: an optimizer passed
        through `wrap_optimizer` keeps its own). Under ZeRO-3, or with gradient accumulation
        that Keras cannot run here, tfdist's step does it instead (`stepped`)."""
        from tfdist import compat
        in_scope = self in getattr(_ACTIVE, "stack", [])
        if self.user_zero and in_scope:  # compiled in the scope
            _SHARDED.add(model)  # (a model loaded later, on one device, is not sharded)
        if self.user_auto is not None and in_scope:
            _AUTO.add(model)  # (measured at its first fit: `stepped`)
        if self.user_skip_nonfinite:
            _CHECKED.add(model)
        optimizer = model.optimizer
        accumulate = getattr(_updating(optimizer), "gradient_accumulation_steps", None) or 1
        if accumulate > 1 and not self.runs_keras_accumulation:
            _ACCUMULATING[model] = accumulate
        if (model in _SHARDED or model in _ACCUMULATING or model in _CHECKED or model in _AUTO
                or optimizer is None):
            return
        if not compat.has_gradient_reduction(optimizer):
            self.wrap_optimizer(optimizer)

    def _auto(self, model, arguments):
        """A model of `get("auto")` at its first fit: built, measured, and sharded or offloaded as
        its memory needs (tfdist.parallel.budget); every process takes the costliest layout any
        process chose (their measurements may differ a little)."""
        from tfdist import compat
        from tfdist.parallel import budget as user_auto
        _AUTO.discard(model)
        batch = _first_batch(arguments)
        if not model.built:
            compat.build_for(model, arguments.get("x"))
        measured = user_auto.measure(model, batch, self.num_replicas)
        from tfdist.runtime import cluster
        budget = user_auto.budget_bytes(self.user_auto, cluster.processes_here())
        device = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
        choice = user_auto.choose(measured, self.num_replicas, budget, device)
        count = len(user_auto.options(measured, self.num_replicas, device))
        agreed = sum(self.any_process(choice.index > i) for i in range(count - 1))
        if agreed != choice.index:
            choice = user_auto.choose_at(measured, agreed, self.num_replicas, device)
        if self.is_chief:
            for line in user_auto.lines(measured, choice, self.num_replicas, budget):
                print(line, flush=True)
        if choice.accumulate > 1:  # tfdist's step sums the pieces (`stepped`)
            _ACCUMULATING[model] = _ACCUMULATING.get(model, 1) * choice.accumulate
            _REBATCHED[model] = choice.accumulate
        if choice.zero in (1, 2):
            _ZERO_STAGE[model] = choice.zero
        elif choice.zero:
            _SHARDED.add(model)
            if choice.offload != "none":
                _AUTO_OFFLOAD[model] = (choice.offload, "")
        if not choice.zero and model not in _ACCUMULATING and model not in _CHECKED:
            if not compat.has_gradient_reduction(model.optimizer):
                self.wrap_optimizer(model.optimizer)  # (as a named strategy's plain model)

    def stepped(self, model, method, arguments):
        """tfdist's step for a user's model (`tfdist.step`): under ZeRO-3, and for an optimizer
        with `gradient_accumulation_steps` = k where Keras's own cannot run (k batches per
        update, summed by tfdist's step; the optimizer's own accumulation is switched off),
        and with `skip_nonfinite` (its non-finite updates skipped: `tfdist.runtime.nonfinite`).
        At the model's first `fit`, `evaluate` or `predict` it is built (from the data's specs,
        if it is not), its weights sharded under ZeRO-3 (`tfdist.parallel.zero.weights`), and
        tfdist's step made its `train_step`. Returns the callbacks that surround a `fit`'s own:
        under ZeRO-3 the weights are whole for the callbacks' epoch ends and after training
        (each process gathers them: a checkpoint or `model.save` reads them as usual)."""
        if model in _AUTO:
            self._auto(model, arguments)
        if method == "fit" and model in _REBATCHED:
            _rebatch(arguments, _REBATCHED[model])
        sharded = model in _SHARDED or model in _ZERO_STAGE
        if not sharded and model not in _ACCUMULATING and model not in _CHECKED:
            return [], []
        from tfdist.parallel import zero
        from tfdist.parallel.layout import Layout
        if not isinstance(model.train_step, _step_class()):
            from tfdist import compat
            from tfdist.parallel.zero import whole
            if not model.built:
                compat.build_for(model, arguments.get("x"))
            loaded = model.optimizer if model.optimizer.built else None  # (a file's, whole)
            if loaded is not None and sharded:
                with self.scope():
                    model.optimizer = type(loaded).from_config(loaded.get_config())
            accumulate = _ACCUMULATING.get(model, 1)
            _updating(model.optimizer).gradient_accumulation_steps = None  # tfdist's step sums
            stage = _ZERO_STAGE.get(model, 3 if model in _SHARDED else 0)
            layout = Layout(dp=self.num_replicas, zero=stage, accumulate=accumulate)
            offload = self._offload(model) if model in _SHARDED else None
            with self.scope():
                skip = self.user_skip_nonfinite if model in _CHECKED else 0
                _step_class()(model, self, layout, skip_nonfinite=skip,
                              offload=offload).install()
            if zero.of(model) is not None:
                if loaded is not None:
                    whole.copy_by_name(model.optimizer, loaded, zero.of(model))
                # (TFDIST_ZERO_SAVE=shard: each process's shard shown, the behaviour before; a
                # companion test's)
                shard = os.environ.get("TFDIST_ZERO_SAVE") == "shard"
                model.tfdist_shown = whole.Shown(zero.of(model), None if shard else model.optimizer)
        shown = getattr(model, "tfdist_shown", None)
        if method != "fit" or shown is None:
            return [], []
        for cb in arguments.get("callbacks") or []:
            if (isinstance(cb, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore))
                    and getattr(cb, "save_freq", "epoch") != "epoch"):
                raise UsageError(f"{type(cb).__name__}(save_freq={cb.save_freq}) under zero=3: a "
                                 f"sharded model is whole at epoch ends only; use "
                                 f"save_freq='epoch'")
        return _whole_for_callbacks(shown)

    def _offload(self, model):
        """A new ZeRO-Offload of a user's `model` (`user_offload`), closed (its files removed,
        and the directory it made) when the model is collected or the process exits; None
        without offload."""
        chosen = _AUTO_OFFLOAD.get(model, self.user_offload)
        if chosen is None:
            return None
        from tfdist.parallel.zero import offload
        kind, base = chosen
        where, ours = None, None
        if kind == "disk":
            ours = None if base else os.path.join(tempfile.gettempdir(),
                                                  f"tfdist-offload-{os.getpid()}")
            where = f"{offload.directory(base or ours, self.worker_index)}-model-" \
                    f"{next(_OFFLOADS)}"
        store = offload.Offload(kind, where)

        def close():
            store.close()
            if ours:  # (the directory this process made, once empty)
                try:
                    os.rmdir(ours)
                except OSError:
                    pass
        weakref.finalize(model, close)  # (at exit too, if the model is alive then)
        return store

    def keras_call(self, method, model, upstream, arguments):
        """`model.<method>(**arguments)` of a model compiled under this plugin: Keras's own
        (`upstream`) with the strategy's callbacks first, and file-writing callbacks and `save`
        kept to the chief (`for_this_process`)."""
        if method == "save":
            return self.save(model, upstream, arguments)
        first, last = self.stepped(model, method, arguments)
        own = self.callbacks() if method == "fit" else []
        arguments["callbacks"] = first + own + self.for_this_process(arguments.get("callbacks")) \
            + last
        return upstream(model, **arguments)

    def for_this_process(self, callbacks):
        """`callbacks` as this process should run them: unchanged on the chief. Elsewhere the
        callbacks that write files (ModelCheckpoint, BackupAndRestore, CSVLogger, TensorBoard)
        write nothing: where saving is a collective operation (`collective_checkpoints`) a
        checkpoint goes to a temporary directory removed when training ends, as TF's
        multi-worker guide does; a BackupAndRestore still restores from the chief's backup."""
        callbacks = list(callbacks or [])
        if self.is_chief:
            return callbacks
        from tfdist import callbacks as callbacks_lib
        out = []
        for cb in callbacks:
            if isinstance(cb, (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)):
                continue
            if isinstance(cb, keras.callbacks.ModelCheckpoint):
                if self.collective_checkpoints:
                    out += [callbacks_lib.Scratch(cb, "filepath")]
                continue
            if isinstance(cb, keras.callbacks.BackupAndRestore):
                out += [callbacks_lib.ReadOnlyBackup(cb, self.collective_checkpoints)]
                continue
            out.append(cb)
        return out

    def save(self, model, upstream, arguments):
        """`model.save`: the chief writes; the others write to a temporary directory they remove
        (where reading the variables may be collective) or not at all."""
        if self.is_chief:
            return upstream(model, **arguments)
        if self.collective_checkpoints:
            scratch = tempfile.mkdtemp(prefix="tfdist-save-")
            try:
                upstream(model, **{**arguments, "filepath": os.path.join(
                    scratch, os.path.basename(str(arguments["filepath"])))})
            finally:
                shutil.rmtree(scratch, ignore_errors=True)


def _first_batch(arguments):
    """The first batch of `fit`'s data (a tf.data.Dataset, or arrays with `batch_size`)."""
    x = arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        return next(iter(x.take(1)))
    leaves = tf.nest.flatten(x) if x is not None else []
    if not leaves or not all(hasattr(a, "shape") and hasattr(a, "__getitem__") for a in leaves):
        raise UsageError("strategy auto measures a step from the data's first batch: give fit a "
                         "tf.data.Dataset, or arrays with batch_size")
    n = arguments.get("batch_size") or 32
    cut = lambda t: None if t is None else tf.nest.map_structure(  # noqa: E731
        lambda a: tf.convert_to_tensor(a[:n]), t)
    return (cut(x), cut(arguments.get("y")), cut(arguments.get("sample_weight")))


def _rebatch(arguments, k):
    """`fit`'s data in batches of 1/k of its rows (auto's accumulation: k pieces an update, the
    same rows), and its epochs k times as many steps."""
    x = arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        rows = tf.nest.flatten(x.element_spec)[0].shape[0]
        if rows is None or rows % k:
            raise UsageError(f"strategy auto splits each batch into {k} pieces, and the dataset's "
                             f"batch size is {rows}: batch it with drop_remainder=True, a "
                             f"multiple of {k}")
        arguments["x"] = x.unbatch().batch(rows // k, drop_remainder=True)  # (in order)
    else:
        arguments["batch_size"] = (arguments.get("batch_size") or 32) // k
    if arguments.get("steps_per_epoch"):
        arguments["steps_per_epoch"] *= k


def _updating(optimizer):
    """The optimizer that updates (a loss-scale optimizer's inner one), whose
    `gradient_accumulation_steps` Keras reads."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def _step_class():
    """tfdist's `TrainStep`. It is the layer above (it calls the strategy): loaded by name, as the
    registry loads plugins, so that the strategies never import it."""
    return importlib.import_module("tfdist.step").TrainStep


def _whole_for_callbacks(shown):
    """([first], [last]) around a user's `fit` callbacks under ZeRO (`tfdist.parallel.zero.whole`):
    the weights and the optimizer shown whole from the first's hook to the last's at the start
    and at each epoch end (a checkpoint, a backup, a restore, Horovod's broadcast read or set
    them), and whole after training (a `model.save` on the chief alone writes them)."""
    first = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs=None: shown.show(),
        on_epoch_end=lambda epoch, logs=None: shown.show(),
        on_train_end=lambda logs=None: shown.show())
    last = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs=None: shown.hide(),
        on_epoch_end=lambda epoch, logs=None: shown.hide())
    return [first], [last]
