"""Every use of Keras's and TensorFlow's private internals, in one place.

A Keras or TF upgrade is this project's largest risk: each function below reaches into something
upstream does not promise to keep. Each one names the upstream issue it works around, the
versions it was written for (`PINNED`), and the test that fails without it (`PATCHES`). When you
upgrade, run those tests with the patch disabled (`TFDIST_DISABLE_PATCHES=<name>,...`, or the
`disable_patches` hook of `tfdist.train.Hooks`): the ones that then pass show a patch upstream
has made unnecessary. `tests/test_compat.py` parses tfdist's sources and fails if a private
attribute of a Keras or TF object (`obj._name`, `keras.src`, `tensorflow.python`) is used
anywhere else. Modules that need no patch import nothing from here.

On import it checks the installed versions against `PINNED` and says so on stderr when they
differ.

Example:

    >>> from tfdist import compat
    >>> sorted(compat.PATCHES)[:2]
    ['gradient_reduction', 'keras_fit_under_parameter_server']
    >>> compat.version_warning({"keras": "3.15.1", "tensorflow": "2.21.0"}) is None
    True
"""
import os
import sys

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as _tf_trainer
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
    "keras_fit_under_parameter_server": (
        "keras-team/keras#18624",
        "Keras 3 model.fit has no ParameterServerStrategy path",
        "tests/test_parameter_server.py::test_a_users_model_trains_with_plain_model_fit"),
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
    """An `IndexedSlices` gradient with at least as many rows as its variable is sent dense: the
    all-reduce then moves less (a byte-level GPT's embedding: 256 dense rows instead of one slice
    per token of the batch). Same update: Keras 3's optimizers treat slices as dense anyway."""
    if isinstance(grad, tf.IndexedSlices):
        rows = grad.indices.shape[0]
        if rows is not None and rows >= var.shape[0]:
            return tf.convert_to_tensor(grad)
    return grad


def set_gradient_reduction(optimizer, all_reduce=None):
    """Sets how `optimizer` reduces gradients across replicas, once, and corrects what a Keras 3
    optimizer (TF backend) does with them under a strategy ("gradient_reduction").

    `all_reduce(grads_and_vars) -> grads_and_vars` replaces Keras's own reduction (the strategy's
    all-reduce, `optimizer._all_reduce_sum_gradients`); None keeps it. Then, on the reduced
    gradients:

    1. Sparse gradients with repeated indices: the all-reduce of an `IndexedSlices` gradient (an
       embedding) concatenates the replicas' slices, and Keras 3's Adam/AdamW then squares the
       slices one by one, so its second moment gets g1^2 + g2^2 instead of (g1 + g2)^2.
       Duplicates are summed after the all-reduce.
    2. `global_clipnorm` is applied in `BaseOptimizer.apply`, before `_backend_update_step`
       all-reduces the gradients, so every replica clips its own partial gradient by its own
       norm. Clipping runs on the summed gradient instead.

    One reduction, one correction: a second call raises instead of wrapping twice.
    """
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
            grads, _ = tf.clip_by_global_norm(grads, clipnorm)
        return list(zip(grads, [v for _, v in reduced]))

    optimizer._all_reduce_sum_gradients = reduce_then_fix
    return optimizer


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


def learning_rate_schedule(optimizer):
    """The optimizer's schedule (or its constant rate variable): `optimizer.learning_rate` gives
    only the current value."""
    return optimizer._learning_rate


def set_learning_rate_schedule(optimizer, schedule):
    optimizer._learning_rate = schedule


# -- a custom train_step, as Keras's own -------------------------------------------------------

def compute_loss(model, x, y, y_pred):
    """The model's compiled loss of one batch, as Keras's `train_step` computes it."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, training=True)


def track_loss(model, loss, batch_size):
    """Updates the model's `loss` metric as Keras's `train_step` does."""
    model._loss_tracker.update_state(unscale_loss_for_distribution(loss), sample_weight=batch_size)


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
             "fit": _tf_trainer.TensorFlowTrainer.fit}


def _reduce_per_replica(values, strategy, reduction):
    """Each replica's metric results averaged across replicas without an axis (also when a
    worker has one replica and they arrive as plain tensors: upstream would report worker 0's)."""
    if (reduction in ("auto", "mean") and _tf_trainer._collective_all_reduce_multi_worker(strategy)
            and not isinstance(strategy, tf.distribute.TPUStrategy)):
        return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
    return _upstream["reduce_per_replica"](values, strategy, reduction)


def fix_fit_under_multi_worker():
    """The two corrections Keras 3.15 `fit` needs under MultiWorkerMirroredStrategy. They change
    nothing for strategies that never reach the patched branches."""
    if "symbolic_build_under_mwms" not in disabled:
        _tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    if "reduce_per_replica_under_mwms" not in disabled:
        _tf_trainer.reduce_per_replica = _reduce_per_replica


# -- Keras fit under ParameterServerStrategy (keras-team/keras#18624) ---------------------------

def route_fit(plugin_for):
    """Routes Keras 3 `model.fit` to `plugin_for(model)(model, x, **fit_arguments)` when that
    returns a function for the model, else to Keras's own `fit`. Keras 3 has no
    ParameterServerStrategy path."""
    if "keras_fit_under_parameter_server" in disabled:
        return
    upstream_fit = _upstream["fit"]

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, validation_batch_size=None,
            validation_steps=None, validation_freq=1, steps_per_epoch=None):
        own = plugin_for(self)
        if own is None:
            return upstream_fit(self, x, y, batch_size, epochs, verbose, callbacks,
                                validation_split, validation_data, shuffle, class_weight,
                                sample_weight, initial_epoch, validation_batch_size,
                                validation_steps, validation_freq, steps_per_epoch)
        return own(self, x, y=y, epochs=epochs, verbose=verbose, callbacks=callbacks,
                   validation_data=validation_data, initial_epoch=initial_epoch,
                   validation_steps=validation_steps, steps_per_epoch=steps_per_epoch)

    _tf_trainer.TensorFlowTrainer.fit = fit


def pending_closures(coordinator):
    """Closures scheduled on a `ClusterCoordinator` and not yet finished (queued or running),
    read from its own queue: TF 2.21 has no public count."""
    q = coordinator._cluster.closure_queue
    with q._queue_lock:
        return q._queue.qsize() + q._inflight_closure_count


# -- Slurm ------------------------------------------------------------------------------------

def slurm_tasks_per_node(text):
    """`SLURM_TASKS_PER_NODE` ('2(x3),1') as a list of counts, parsed by TF's Slurm resolver."""
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm
    return slurm.expand_tasks_per_node(text)
