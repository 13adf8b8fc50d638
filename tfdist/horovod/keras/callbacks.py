"""`hvd.callbacks` of `tfdist.horovod.keras`: Horovod's Keras callbacks for Keras 3.

* `BroadcastGlobalVariablesCallback(root_rank)`: the root's model and optimizer state to every
  rank before the first step (`tfdist.strategies.horovod.broadcast_from_root`);
* `MetricAverageCallback()`: the logged metrics averaged over the ranks at every batch and epoch
  end (`tfdist.strategies.horovod.average_logs`); put it before the callbacks that read metrics;
* `LearningRateScheduleCallback(initial_lr, multiplier, start_epoch, end_epoch, staircase)`: the
  learning rate is `initial_lr * multiplier(epoch)` in [start_epoch, end_epoch), set at each
  epoch (`staircase=True`) or each batch with a fractional epoch;
* `LearningRateWarmupCallback(initial_lr, warmup_epochs)`: from `initial_lr / size()` to
  `initial_lr` over the warmup epochs (Goyal et al., https://arxiv.org/abs/1706.02677).

The learning rate is set through `optimizer.learning_rate`, so the optimizer needs a float rate
(not a `LearningRateSchedule`). `momentum_correction` has no effect: Keras 3's momentum is a
constant of the compiled step.
"""
import horovod.tensorflow as _hvd
import keras

from tfdist.horovod.keras.notes import note
from tfdist.strategies import horovod as _plugin


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    def __init__(self, root_rank, device=""):
        super().__init__()
        if device:
            note(f"BroadcastGlobalVariablesCallback(device={device!r}) has no effect on Keras 3")
        self.root_rank = root_rank

    def on_train_begin(self, logs=None):
        _plugin.broadcast_from_root(_hvd, self.model, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    def __init__(self, device=""):
        super().__init__()
        if device:
            note(f"MetricAverageCallback(device={device!r}) has no effect on Keras 3")

    def on_train_batch_end(self, batch, logs=None):
        _plugin.average_logs(_hvd, logs, "batch")

    def on_epoch_end(self, epoch, logs=None):
        _plugin.average_logs(_hvd, logs, "epoch")


class LearningRateScheduleCallback(keras.callbacks.Callback):
    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.epoch = 0

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        if isinstance(optimizer.learning_rate, keras.optimizers.schedules.LearningRateSchedule) \
                or not hasattr(optimizer.learning_rate, "assign"):
            raise ValueError(f"{type(self).__name__} sets the learning rate, but the optimizer has "
                             f"a LearningRateSchedule; give it a float learning_rate")
        if self.momentum_correction and getattr(optimizer, "momentum", 0):
            note(f"{type(self).__name__}(momentum_correction=True) has no effect on Keras 3 "
                 f"(momentum is a constant of the compiled step)")
        self.steps_per_epoch = self.steps_per_epoch or self.params.get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError(f"{type(self).__name__} needs steps_per_epoch (fit was given none)")

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch):
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._set(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase and self._in_range(self.epoch):
            self._set(self.epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                 verbose=0):
        n = _hvd.size()

        def multiplier(epoch):  # as Horovod's: + 1 step, so each epoch ends on a round value
            epoch += 1.0 / self.steps_per_epoch
            return (epoch * (n - 1) / warmup_epochs + 1) / n

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _hvd.rank() == 0:
            lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")
