"""Every use of Keras's and TensorFlow's private internals, in one place.

A Keras or TF upgrade is this project's largest risk: each function below reaches into something
upstream does not promise to keep. Each one names the upstream issue it works around, the
versions it was written for (`PINNED`), and the test that fails without it (`PATCHES`). When you
upgrade, run those tests with the patch disabled (`TFDIST_DISABLE_PATCHES=<name>,...`, or the
`disable_patches` hook of `tfdist.train.Hooks`): the ones that then pass show a patch upstream
has made unnecessary. `tests/test_compat.py` fails if a private attribute of a Keras or TF
object (`obj._name`, `keras.src`, `tensorflow.python`) is used anywhere else. Modules that need
no patch import nothing from here. On import it says on stderr if the versions differ from PINNED.

Example:

    >>> from tfdist import compat
    >>> sorted(compat.PATCHES)[:2]
    ['gradient_reduction', 'keras_methods_follow_the_strategy']
    >>> compat.version_warning({"keras": "3.15.1", "tensorflow": "2.21.0"}) is None
    True
"""
import functools
import inspect
import os
import sys
import threading

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as _tf_trainer
from keras.src.trainers import trainer as _trainer
from keras.src.losses.loss import unscale_loss_for_distribution

#: The versions every patch here was written and tested for.
PINNED = {"keras": "3.15.1", "tensorflow": "2.21.0"}

#: name -> (upstream issue, what it works around, the test that shows it is still needed).
PATCHES = {
    "gradient_reduction": (
        "tensorflow/tensorflow#33929 (clipping before aggregation); Keras 3 sums no duplicate "
        "sparse slices (tf.keras's _deduplicate_indexed_slices is gone)",
        "Keras 3 optimizers under a strategy: global_clipnorm clips each replica's partial "
        "gradient, and Adam squares duplicate IndexedSlices one by one",
        "tests/test_strategies.py::test_optimizer_corrections_make_mirrored_equal_single"),
    "symbolic_build_under_mwms": (
        "keras-team/keras#20585",
        "TensorFlowTrainer._maybe_symbolic_build reduces the first PerReplica batch and fails "
        "under MultiWorkerMirroredStrategy ('Attempt to convert a value (PerReplica...')",
        "tests/test_multi_worker.py::test_each_keras_correction_is_needed[1]"),
    "reduce_per_replica_under_mwms": (
        "keras-team/keras#20585",
        "reduce_per_replica(..., 'mean') under MultiWorkerMirrored fails on the scalar loss "
        "(axis 0) or reports worker 0's loss only",
        "tests/test_multi_worker.py::test_each_keras_correction_is_needed[2]"),
    "keras_methods_follow_the_strategy": (
        "keras-team/keras#18624 (no ParameterServerStrategy path in fit); Keras 3 has no hook "
        "for a strategy that is not a tf.distribute one (Horovod)",
        "a user's compile/fit/evaluate/predict/save under tfdist's strategies: gradient "
        "all-reduce without wrap_optimizer, split input, the parameter server's coordinator",
        "tests/test_keras_programs.py::test_without_routing_horovod_ranks_read_whole_batches"),
    "pending_closures": (
        "none (no public API): tf.distribute.coordinator.ClusterCoordinator's queue length",
        "polling a step counter on the ps instead costs the ps and the chief about a quarter "
        "core each",
        "tests/test_parameter_server.py::test_a_paused_worker_does_not_stop_the_other"),
    "update_on_variable_device": (
        "none found: Keras 3 (TF backend, default strategy) leaves the optimizer's update math "
        "without a device",
        "a pipeline's updates would all run on its first device",
        "tests/test_pipeline.py::test_every_stage_is_on_its_device"),
    "learning_rate_schedule": (
        "none: Keras 3 exposes a schedule only through optimizer._learning_rate",
        "Horovod's linear learning-rate scaling wraps the schedule, warmup included",
        "tests/test_horovod.py::test_learning_rate_scaling_keeps_the_warmup"),
    "pipeline_train_step": (
        "none: Keras's own train_step uses Trainer._compute_loss, _loss_tracker and "
        "keras.src.losses.loss.unscale_loss_for_distribution",
        "the pipeline's train_step takes tf.gradients (placement per stage) and must track its "
        "loss as Keras's train_step does",
        "tests/test_pipeline.py::test_losses_over_ten_steps_equal_the_unsplit_model"),
    "slurm_tasks_per_node": (
        "none: TF's SlurmClusterResolver keeps its SLURM_TASKS_PER_NODE parser in "
        "tensorflow.python",
        "reading '2(x3),1' task counts as TF's resolver does",
        "tests/test_cluster.py::test_slurm_environment_builds_the_cluster"),
}


def version_warning(installed=None):
    """A one-line warning when the installed Keras/TF differ from `PINNED`, else None."""
    installed = installed or {"keras": keras.__version__, "tensorflow": tf.__version__}
    off = [f"{k} {installed[k]} (written for {v})" for k, v in PINNED.items()
           if not installed[k].startswith(v)]
    if not off:
        return None
    return (f"tfdist: warning: {', '.join(off)}: tfdist/compat.py patches private internals of "
            f"the pinned versions; run tests/test_compat.py and each patch's test (compat.PATCHES)")


_warning = version_warning()
if _warning:
    print(_warning, file=sys.stderr, flush=True)

#: Patches not to apply: a test hook that shows a patch is still needed.
disabled = set(filter(None, os.environ.get("TFDIST_DISABLE_PATCHES", "").split(",")))


def disable(*names):
    unknown = set(names) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown patch(es) {sorted(unknown)}; known: {sorted(PATCHES)}")
    disabled.update(names)


# -- optimizers ---------------------------------------------------------------------------------

def _sum_duplicates(grad):
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    unique, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, grad.dense_shape)


def _smaller_form(grad, var):
    """An `IndexedSlices` gradient with at least as many rows as its variable is sent dense, which
    moves less (a byte GPT's embedding: 256 rows, not a slice per token); Keras 3 densifies it."""
    if isinstance(grad, tf.IndexedSlices):
        rows = grad.indices.shape[0]
        if rows is not None and rows >= var.shape[0]:
            return tf.convert_to_tensor(grad)
    return grad


def set_gradient_reduction(optimizer, all_reduce=None, norm_sum=None):
    """Sets how `optimizer` reduces gradients across replicas, once, and corrects what a Keras 3
    optimizer (TF backend) does with them under a strategy ("gradient_reduction").

    `all_reduce(grads_and_vars) -> grads_and_vars` replaces Keras's own reduction (the strategy's
    all-reduce, `optimizer._all_reduce_sum_gradients`); None keeps it. On the reduced gradients:
    1. The all-reduce of an `IndexedSlices` gradient (an embedding) concatenates the replicas'
       slices, and Keras 3's Adam/AdamW squares them one by one (its second moment gets g1^2 +
       g2^2, not (g1 + g2)^2): duplicates are summed after the all-reduce.
    2. `BaseOptimizer.apply` clips by `global_clipnorm` before `_backend_update_step` all-reduces,
       so each replica clips its partial gradient by its own norm: clipping runs after instead.
    `norm_sum(x)`: x summed over replicas, where `all_reduce` gives each its shard only (ZeRO).
    One reduction, one correction: a second call raises instead of wrapping twice."""
    if getattr(optimizer, "_tfdist_reduction", False):
        raise ValueError("the optimizer's gradient reduction is already set (wrap it once)")
    reduce = all_reduce or optimizer._all_reduce_sum_gradients
    optimizer._tfdist_reduction = True
    if "gradient_reduction" in disabled:
        if all_reduce:
            optimizer._all_reduce_sum_gradients = all_reduce
        return optimizer
    clipnorm = optimizer.global_clipnorm
    optimizer.global_clipnorm = None

    def reduce_then_fix(grads_and_vars):
        reduced = reduce([(_smaller_form(g, v), v) for g, v in grads_and_vars])
        grads = [_sum_duplicates(g) for g, _ in reduced]
        if clipnorm:
            norm = None if norm_sum is None else tf.sqrt(norm_sum(tf.add_n(
                [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads])))
            grads, _ = tf.clip_by_global_norm(grads, clipnorm, use_norm=norm)
        return list(zip(grads, [v for _, v in reduced]))

    optimizer._all_reduce_sum_gradients = reduce_then_fix
    return optimizer


def has_gradient_reduction(optimizer):  # whether set_gradient_reduction has been applied
    return getattr(optimizer, "_tfdist_reduction", False)


def update_on_variable_device(optimizer):
    """Runs each variable's optimizer update on that variable's device ("update_on_variable_device").
    Keras 3 (TF backend, default strategy) leaves the update math without a device, so TF would
    run every pipeline stage's updates on the first device and copy gradients back and forth."""
    if getattr(optimizer, "_tfdist_placed", False) or "update_on_variable_device" in disabled:
        return
    update_step = optimizer.update_step

    def placed(gradient, variable, learning_rate):
        with tf.device(variable.device):
            return update_step(gradient, variable, learning_rate)

    optimizer.update_step = placed
    optimizer._tfdist_placed = True


def learning_rate_schedule(optimizer):  # `optimizer.learning_rate` is only the current value
    return optimizer._learning_rate


def set_learning_rate_schedule(optimizer, schedule):
    optimizer._learning_rate = schedule


def replace_sublayer(parent, attr, layer):  # parent.<attr> = layer; Keras would track both
    parent._tracker.untrack(getattr(parent, attr))
    setattr(parent, attr, layer)


# -- a custom train_step, as Keras's own -------------------------------------------------------

def compute_loss(model, x, y, y_pred):
    """The model's compiled loss of one batch, as Keras's `train_step` computes it."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, training=True)


def track_loss(model, loss, batch_size):
    """Updates the model's `loss` metric as Keras's `train_step` does."""
    model._loss_tracker.update_state(unscale_loss_for_distribution(loss), sample_weight=batch_size)


def train_step_loss(model, batch):
    """Runs Keras's `train_step` on `batch` and returns that step's own loss. `train_step` returns
    the loss tracker's mean since its last reset; under the parameter server the tracker's
    variables are on the ps, shared by every worker and reset by the chief at each report, so that
    mean mixed steps and resets (logged losses from 0.4 to 20 where the steps' were near 2.5)."""
    seen, tracker = [], model._loss_tracker
    update = tracker.update_state
    tracker.update_state = lambda values, **kw: seen.append(values) or update(values, **kw)
    try:
        model.train_step(batch)
    finally:
        del tracker.update_state  # the class's method again
    return seen[0]


def test_step_given(model, x, y, y_pred, sample_weight=None):
    """Keras's `test_step` for outputs `y_pred` computed elsewhere (the parameter server's
    workers): the compiled loss into the model's loss tracker, then the compiled metrics."""
    y_pred = tree.map_structure(tf.convert_to_tensor, y_pred)
    loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=False)
    first = next(i for i in tree.flatten(x) if i is not None)
    model._loss_tracker.update_state(unscale_loss_for_distribution(loss),
                                     sample_weight=tf.shape(first)[0])
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


# -- Keras fit under MultiWorkerMirroredStrategy (keras-team/keras#20585) -----------------------

def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Shapes are all the symbolic build needs: the first local replica's batch, not a reduce."""
    if self._distribute_strategy is None:
        return
    if iterator is not None:
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda x: (self.distribute_strategy.experimental_local_results(x)[0]
                           if isinstance(x, tf.distribute.DistributedValues) else x), batch)
            break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


_upstream = {"reduce_per_replica": _tf_trainer.reduce_per_replica,
             "compile": _trainer.Trainer.compile,
             "fit": _tf_trainer.TensorFlowTrainer.fit,
             "evaluate": _tf_trainer.TensorFlowTrainer.evaluate,
             "predict": _tf_trainer.TensorFlowTrainer.predict,
             "save": keras.Model.save}


def _reduce_per_replica(values, strategy, reduction):
    """Metric results averaged over replicas without an axis (also when a worker has one replica
    and they arrive as plain tensors: upstream would report worker 0's)."""
    if (reduction in ("auto", "mean") and _tf_trainer._collective_all_reduce_multi_worker(strategy)
            and not isinstance(strategy, tf.distribute.TPUStrategy)):
        # A metric whose result() is a variable (SUM on read): its read is the total already,
        # as upstream leaves it under MirroredStrategy.
        return tree.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None)
            if isinstance(v, (tf.Tensor, tf.distribute.DistributedValues)) else v, values)
    return _upstream["reduce_per_replica"](values, strategy, reduction)


def fix_fit_under_multi_worker():
    """The two corrections Keras 3.15 `fit` needs under MultiWorkerMirroredStrategy. They change
    nothing for strategies that never reach the patched branches."""
    if "symbolic_build_under_mwms" not in disabled:
        _tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    if "reduce_per_replica_under_mwms" not in disabled:
        _tf_trainer.reduce_per_replica = _reduce_per_replica


# -- Keras methods follow the strategy (keras-team/keras#18624 and no hook upstream) ------------

def route_keras(owner_of):
    """Routes Keras 3 `compile`, `fit`, `evaluate`, `predict` and `Model.save` of a model to the
    tfdist strategy plugin that owns it ("keras_methods_follow_the_strategy").

    Keras 3 has no hook through which a strategy adapts them: `fit` has no ParameterServerStrategy
    path (keras-team/keras#18624), and Horovod, no tf.distribute strategy, has no way to
    all-reduce gradients or split input. `compile` asks `owner_of(model, compiling=True)` (the
    plugin then adopts the model: `before_compile`, Keras's compile, `after_compile`); the others
    go to `owner_of(model).keras_call(method, model, upstream, arguments)` (arguments bound by
    name; `upstream` is Keras's own), or to Keras's own without an owner. Idempotent. Calls Keras
    makes itself (fit's validation) and calls from inside a `keras_call` go to Keras's own.
    """
    if _trainer.Trainer.compile is not _upstream["compile"]:
        return
    if "keras_methods_follow_the_strategy" in disabled:
        return

    @functools.wraps(_upstream["compile"])  # keeps Keras's `_is_default` marks, which saving reads
    def compile(self, *args, **kwargs):
        owner = owner_of(self, compiling=True)
        if owner is not None:
            arguments = _bind("compile", self, args, kwargs)
            owner.before_compile(self, arguments)
            _upstream["compile"](self, **arguments)
            owner.after_compile(self)
            return
        _upstream["compile"](self, *args, **kwargs)

    def routed(method):
        @functools.wraps(_upstream[method])
        def call(self, *args, **kwargs):
            inside = getattr(_inside, "active", False)
            owner = None if kwargs.get("_use_cached_eval_dataset") or inside else owner_of(self)
            if owner is None:
                return _upstream[method](self, *args, **kwargs)
            arguments = _bind(method, self, args, kwargs)
            _inside.active = True
            try:
                return owner.keras_call(method, self, _upstream[method], arguments)
            finally:
                _inside.active = False
        return call

    _trainer.Trainer.compile = compile  # Trainer's: Keras compiles a loaded model only when
    # `compile` is Trainer's own
    for method in ("fit", "evaluate", "predict"):
        setattr(_tf_trainer.TensorFlowTrainer, method, routed(method))
    keras.Model.save = routed("save")


def _bind(method, model, args, kwargs):
    """The call's arguments by name (defaults included), as Keras's own method takes them."""
    bound = inspect.signature(_upstream[method]).bind(model, *args, **kwargs)
    bound.apply_defaults()
    arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


_inside = threading.local()


def keras_method(name):
    """Keras's own `fit`/`evaluate`/`predict`/`compile`/`save`, as if tfdist had not routed it."""
    return _upstream[name]


def optimizer_strategy(optimizer):
    """The tf.distribute strategy a Keras 3 optimizer was created (and creates variables) under."""
    return optimizer._distribution_strategy


def local_variables(strategy):
    """A scope where variables made under `strategy` (MirroredStrategy's family) are plain ones on
    this process's first device, not mirrored ones the workers initialise by a collective
    broadcast (ZeRO's slot shards differ per worker). No public API: TF 2.21 skips mirroring
    only for `colocate_with=numpy_dataset.SingleDevice`, which this sets after Keras's own."""
    from tensorflow.python.distribute.numpy_dataset import SingleDevice
    device = SingleDevice(strategy.extended.worker_devices[0])
    return tf.variable_creator_scope(lambda next_creator, **kwargs: next_creator(
        **{**kwargs, "colocate_with": device}))


def flatten_metrics(model, logs):
    """`evaluate`'s return value from its logs, as Keras orders them (`return_dict=False`)."""
    return model._flatten_metrics_in_order(logs)


def redirect_backup(callback, directory):
    """Keras's `BackupAndRestore` writing to `directory` from now on (its paths are private)."""
    callback.backup_dir = directory
    callback._weights_path = os.path.join(directory, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(directory, "training_metadata.json")
    callback._prev_weights_path = callback._weights_path + ".bkp"
    callback._prev_training_metadata_path = callback._training_metadata_path + ".bkp"


def build_for(model, dataset):
    """Builds the model, compiled loss and metrics and optimizer from `dataset`'s specs, as `fit`
    does under a tf.distribute strategy (else a subclassed model is built by its first step)."""
    if isinstance(dataset, tf.data.Dataset):
        with model.distribute_strategy.scope():
            model._symbolic_build(data_batch=dataset.element_spec)


def take_initial_epoch(model):
    """The epoch Keras's `BackupAndRestore` restored into `model` (or None), cleared as fit does."""
    epoch, model._initial_epoch = model._initial_epoch, None
    return epoch


def pending_closures(coordinator):
    """A `ClusterCoordinator`'s closures queued or running (its own queue: TF 2.21 has no count)."""
    q = coordinator._cluster.closure_queue
    with q._queue_lock:
        return q._queue.qsize() + q._inflight_closure_count


# -- Slurm ------------------------------------------------------------------------------------

def xspace():
    """An empty XSpace, the protobuf TF's profiler writes (`*.xplane.pb`). TF has no public
    reader for it (TensorBoard's profile plugin parses it with this same generated module);
    `tensorflow.tsl.profiler.protobuf` is where the TF 2.21 wheel ships it."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    return xplane_pb2.XSpace()


def slurm_tasks_per_node(text):
    """`SLURM_TASKS_PER_NODE` ('2(x3),1') as a list of counts, parsed by TF's Slurm resolver."""
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm
    return slurm.expand_tasks_per_node(text)
