"""Horovod's elastic Keras API on Keras 3: `hvd.elastic` of `tfdist.horovod.keras`.

    import tfdist.horovod.keras as hvd        # was: import horovod.tensorflow.keras as hvd
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(dataset, steps_per_epoch=..., epochs=epochs - state.epoch, callbacks=callbacks)
    train(state)

run under `horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script D ...` (Gloo). The
state is committed in memory; after a rank fails it is rolled back to the last commit, and after
hosts are added or removed Horovod is reset and the state broadcast from the new rank 0, without
a disk read. A whole program: tests/support/horovod_keras_elastic.py.

Horovod's own machinery is used as it is: `horovod.common.elastic.run_fn` (the retry loop, the
worker notification service, `State.commit`, `check_host_updates`, reset callbacks),
`ObjectState`, `horovod.tensorflow.elastic._reset` (shutdown, init), `broadcast_object` and
`CommitStateCallbackImpl`. Replaced, because they break on Keras 3:

* `TensorFlowKerasState`, `KerasState`: Horovod's call `optimizer.variables()`, a list on Keras 3
  (`TypeError: 'list' object is not callable`, horovod/horovod#4290), and broadcast Keras 3
  variables with `broadcast_variables` (`'Variable' object has no attribute 'ref'`). Here the
  model's and optimizer's variables are copied in memory at each commit, restored on a failure,
  and broadcast from rank 0 at each sync (the plugin's `broadcast_variables`). The
  optimizer is built at construction, so that a rank that joins later holds the same variables
  as rank 0 (otherwise the broadcast mismatches and hangs, horovod/horovod#2652). Horovod's
  `TensorFlowState` also broadcasts in its constructor in eager mode, a collective no running
  rank matches: a joining rank hangs there (measured). Here the broadcast is in `sync` only.
* `run`: Horovod's TensorFlow wrapper turns a failed collective into `HorovodInternalError` only
  if the error names `HorovodAllreduce`, `HorovodAllgather` or `HorovodBroadcast`, and otherwise
  returns None: training silently ends. Keras 3 through this drop-in fails in
  `HorovodGroupedAllreduce` ("Horovod has been shut down"). Here any TF op error that mentions
  Horovod is a `HorovodInternalError`; anything else is raised.
* `UpdateBatchStateCallback`: Horovod's shortens the first epoch after a reset by writing
  `self.params['steps']`, which Keras 3's `fit` never reads again. Here that epoch ends early
  (`model.stop_training`, for that epoch only).
* `UpdateEpochStateCallback`: counts from the first epoch `fit` runs, so it is right for both
  `epochs=epochs - state.epoch` (Horovod's docs) and `initial_epoch=state.epoch`.

Horovod's driver blacklists the host of a worker that exits non-zero. Give
`--blacklist-cooldown-range` (e.g. `1 2`) so that a host whose worker was killed can come back,
and on one machine list it under two names (`localhost:1`, `127.0.0.1:1`): with one name a
killed rank blacklists every slot and ends the job. What stays as in Horovod: `state.batch`
counts batches of the old size after a resize; `DistributedOptimizer(gradient_predivide_factor)`
and `LearningRateWarmupCallback` read `size()` once, when they are made.
"""
import functools

import horovod.tensorflow as _hvd
import keras
import tensorflow as tf
from horovod._keras import elastic as _impl
from horovod.common.elastic import ObjectState, State, run_fn  # noqa: F401  (as Horovod has them)
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from horovod.tensorflow.elastic import _reset
from horovod.tensorflow.functions import broadcast_object
from horovod.tensorflow.mpi_ops import rank

from tfdist.strategies import horovod as _plugin


def _is_horovod_failure(error):
    message = getattr(error, "message", "") or str(error)
    return "Horovod" in message  # "Horovod has been shut down", HorovodGroupedAllreduce, ...


def run(func):
    """Horovod's `hvd.elastic.run`: runs `func(state, ...)`, and after a rank fails or hosts are
    added or removed, resets Horovod, syncs `state` from rank 0 and runs it again."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            if _is_horovod_failure(e):
                raise HorovodInternalError(e) from e
            raise

    return run_fn(wrapper, _reset)


def _broadcast_variables(variables, root_rank):  # (as tfdist.horovod.keras.broadcast_variables)
    _plugin.broadcast_variables(_hvd, variables, root_rank)


def _tensor(v):  # the TF variable of a Keras 3 variable
    return v.value if isinstance(v, keras.Variable) else v


class TensorFlowKerasState(ObjectState):
    """State of a Keras 3 model and its optimizer (plus any keyword attributes, e.g. batch=0,
    epoch=0). `backend` is accepted for Horovod's signature and unused."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        if self.optimizer is None:
            raise ValueError("TensorFlowKerasState needs an optimizer: compile the model first "
                             "or pass optimizer=")
        self.backend = backend
        if not self.optimizer.built:  # the same variables on a new rank as on rank 0
            self.optimizer.build(model.trainable_variables)
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _variables(self):
        return list(self.model.variables) + list(self.optimizer.variables)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def sync(self):
        _broadcast_variables(self._variables(), root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self):
        self._saved_values = [tf.identity(_tensor(v)) for v in self._variables()]

    def _load_model(self):
        variables = self._variables()
        if len(variables) != len(self._saved_values):
            raise RuntimeError(f"the model and optimizer have {len(variables)} variables, the "
                               f"committed state {len(self._saved_values)}")
        for v, value in zip(variables, self._saved_values):
            v.assign(value)


class KerasState(TensorFlowKerasState):
    """State of a Keras 3 model and its optimizer (Horovod's `hvd.elastic.KerasState`)."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(_impl.CommitStateCallbackImpl, keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and at each epoch end (Horovod's)."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__(keras.backend, state, batches_per_commit)


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` = the batches done in the current epoch (0 at each epoch end). After a
    reset in mid-epoch, the first epoch `fit` runs is shortened by `state.batch` batches (needs
    `steps_per_epoch`); put this callback before `CommitStateCallback` so that each commit holds
    the batch count of the weights it saves (in Horovod's documented order it holds one less,
    and one batch is run again after a failure)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._offset = 0
        self._first_epoch = True
        self._ended_early = False

    def on_train_begin(self, logs=None):
        self._first_epoch = True
        self._ended_early = False

    def on_epoch_begin(self, epoch, logs=None):
        self._offset = self.state.batch if self._first_epoch else 0
        self._first_epoch = False

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1
        steps = (self.params or {}).get("steps")
        if self._offset and steps and self.state.batch >= steps:
            self.model.stop_training = True  # ends this epoch only (see on_epoch_end)
            self._ended_early = True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._offset = 0
        if self._ended_early:
            self.model.stop_training = False
            self._ended_early = False


class UpdateEpochStateCallback(_impl.UpdateEpochStateCallbackImpl, keras.callbacks.Callback):
    """Keeps `state.epoch` = the epochs done, across resets (Horovod's)."""

    def __init__(self, state):
        super().__init__(keras.backend, state)
        self._first_epoch = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._first_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._first_epoch is None:
            self._first_epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + (epoch - self._first_epoch) + 1


__all__ = [
    "KerasState",
    "TensorFlowKerasState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
    "State",
    "ObjectState",
]
