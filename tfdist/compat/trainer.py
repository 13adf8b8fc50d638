"""Keras 3's trainer (TF backend): its loss metric, its build, `fit` under MultiWorkerMirrored,
and what `BackupAndRestore` and `evaluate` keep private. Each function names its row of the patch
table (`tfdist/compat/table.py`)."""
import os

import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as _tf_trainer
from keras.src.losses.loss import unscale_loss_for_distribution

from tfdist.compat.table import using

_REDUCE_PER_REPLICA = _tf_trainer.reduce_per_replica  # Keras's own


# -- the loss metric, as Keras's train_step and test_step keep it ("loss_tracker") -------------

def track_loss(model, loss, batch_size):
    """Updates the model's `loss` metric as Keras's `train_step` does (switched off: none)."""
    if not using("loss_tracker"):
        return
    model._loss_tracker.update_state(unscale_loss_for_distribution(loss), sample_weight=batch_size)


def train_step_loss(model, batch):
    """Runs the model's `train_step` on `batch` and returns that step's own loss. `train_step`
    returns the loss tracker's mean since its last reset; under the parameter server the tracker's
    variables are on the ps, shared by every worker and reset by the chief at each report, so that
    mean mixed steps and resets (logged losses from 0.4 to 20 where the steps' were near 2.5)."""
    return train_step_losses(model, lambda: model.train_step(batch))[0]


def train_step_losses(model, call):
    """Runs `call()` (steps of the model) and returns each step's own loss, in order, as
    `train_step_loss` does for one."""
    using("loss_tracker")
    seen = []  # the losses the steps passed to the tracker
    tracker = model._loss_tracker
    update = tracker.update_state
    tracker.update_state = lambda values, **kw: seen.append(values) or update(values, **kw)
    try:
        call()
    finally:
        del tracker.update_state  # the class's method again
    return seen


def test_step_given(model, x, y, y_pred, sample_weight=None):
    """Keras's `test_step` for outputs `y_pred` computed elsewhere (the parameter server's
    workers): the compiled loss into the model's loss tracker, then the compiled metrics."""
    using("loss_tracker")
    y_pred = tree.map_structure(tf.convert_to_tensor, y_pred)
    loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=False)  # (also for a compute_loss without `training`)
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
    return _REDUCE_PER_REPLICA(values, strategy, reduction)


def fix_fit_under_multi_worker():
    """The two corrections Keras 3.15 `fit` needs under MultiWorkerMirroredStrategy
    ("symbolic_build_under_mwms", "reduce_per_replica_under_mwms"). They change nothing for
    strategies that never reach the patched branches."""
    if using("symbolic_build_under_mwms"):
        _tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    if using("reduce_per_replica_under_mwms"):
        _tf_trainer.reduce_per_replica = _reduce_per_replica


# -- what Keras keeps private ---------------------------------------------------------------------

def build_for(model, dataset):
    """Builds the model, compiled loss and metrics and optimizer from `dataset`'s specs, as `fit`
    does under a tf.distribute strategy (else a subclassed model is built by its first step):
    "symbolic_build"."""
    if isinstance(dataset, tf.data.Dataset):
        using("symbolic_build")
        with model.distribute_strategy.scope():
            model._symbolic_build(data_batch=dataset.element_spec)


def flatten_metrics(model, logs):
    """`evaluate`'s return value from its logs, as Keras orders them (`return_dict=False`):
    "metrics_order"."""
    using("metrics_order")
    return model._flatten_metrics_in_order(logs)


def redirect_backup(callback, directory):
    """Keras's `BackupAndRestore` writing to `directory` from now on ("backup_paths")."""
    using("backup_paths")
    callback.backup_dir = directory
    callback._weights_path = os.path.join(directory, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(directory, "training_metadata.json")
    callback._prev_weights_path = callback._weights_path + ".bkp"
    callback._prev_training_metadata_path = callback._training_metadata_path + ".bkp"


def take_initial_epoch(model):
    """The epoch Keras's `BackupAndRestore` restored into `model` (or None), cleared as fit does
    ("backup_paths")."""
    using("backup_paths")
    epoch, model._initial_epoch = model._initial_epoch, None
    return epoch


def replace_sublayer(parent, attr, layer):
    """parent.<attr> = layer, the old layer no longer tracked (Keras would keep both):
    "replace_sublayer"."""
    using("replace_sublayer")
    parent._tracker.untrack(getattr(parent, attr))
    setattr(parent, attr, layer)


# -- a train function that chooses its step per batch ("train_function_per_batch") -------------

def train_function_per_batch(model, choose, steps, after=None):
    """Makes `model`'s Keras train function run, for each batch, the step `steps[choose()]`
    (`steps`: {name: a function of one batch, as `train_step` is}), each made into a train
    function as Keras makes its own (`_make_function`: the strategy's `run`, the per-replica
    reduction of its logs). `choose` runs on the host, before each batch; `after(logs)`, if
    given, after it (its result is the logs Keras sees). Keras's `make_train_function` is
    replaced on this model only."""
    using("train_function_per_batch")

    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function
        made = {name: model._make_function(step) for name, step in steps.items()}

        def train_function(iterator):
            logs = made[choose()](iterator)
            return after(logs) if after else logs
        model.train_function = train_function
        return train_function

    model.make_train_function = make_train_function
    model.train_function = None
