"""The parameter server's training loop: Keras's `fit` as a `ClusterCoordinator` loop on the chief.

Keras 3 `fit` does not support ParameterServerStrategy (keras-team/keras#18624). Here every step
is a closure scheduled on whichever worker is free, at most `2 x workers` in flight. tfdist's
data is addressed by step, so each batch is trained on once, also when a closure runs again after
a worker failure (a plain `tf.data.Dataset`: worker w reads batches w, w + N, ...). The step count
is exact: each step marks itself done in a mask on the ps, and `iterations` is set from that count
at every report (Keras 3's `assign_add` loses increments under concurrency). Callbacks run every
10 completed steps (`logs["tfdist/steps"]` says how many); before a backup, at each epoch end and
after a preemption signal the loop waits for every step in flight, so a backup holds exactly the
steps counted. A callback that sets `model.stop_training` (a loss spike's watch) ends the epoch
at that report, once the steps in flight are done, as Keras's `fit` ends it after that batch.
With gradient accumulation over k steps (tfdist's step, `train.grad_accum_steps`), a closure is
an update: its worker takes k consecutive steps' batches, sums their gradients and applies their
mean once, as one asynchronous update; each of its k steps is counted as before.
The plugin (`tfdist.strategies.parameter_server.plugin`) calls `fit`.

Usage (not run as a doctest: a chief with TF_CONFIG listing chief, worker and ps tasks):

    history = fit(plugin, model, windows, epochs=2, steps_per_epoch=100, callbacks=[...])
"""
import time

import numpy as np

from tfdist.errors import UsageError
from tfdist.runtime.lazy import keras, tf


def fit(plugin, model, data, *, epochs=1, steps_per_epoch=None, initial_step=0, callbacks=None,
        validation_data=None, validation_steps=None, verbose="auto", log_every_steps=None,
        strategy_callbacks=None, progress_every=1):
    """The coordinator loop (see the module doc). `data` is a `Windows`-like object with
    `batch(step)`, or a `tf.data.Dataset` / `dataset_fn()` read through per-worker datasets."""
    from tfdist import compat
    if not steps_per_epoch:
        raise UsageError("parameter_server training needs steps_per_epoch (there is no end of "
                         "data to detect: each worker reads its own copy); pass steps_per_epoch")
    if hasattr(data, "dataset_fn") and not step_addressed(data):
        raise UsageError("parameter_server needs step-addressed data (with batch(step)) or a "
                         "tf.data.Dataset")
    k = getattr(model.train_step, "window", 1)  # steps per update: tfdist's step accumulates
    if steps_per_epoch % k or initial_step % k:
        raise UsageError(f"under parameter_server an update of {k} accumulated steps is one "
                         f"closure: steps_per_epoch ({steps_per_epoch}) and the initial step "
                         f"({initial_step}) must be multiples of {k}")
    callbacks = list(callbacks or [])
    if verbose not in (0, False):
        from tfdist.callbacks import Progress
        callbacks.append(Progress(every=progress_every))  # last: it shows what others add
    history = keras.callbacks.History()
    cbs = keras.callbacks.CallbackList(callbacks + [history], model=model, epochs=epochs,
                                       steps=steps_per_epoch, verbose=0)
    model.stop_training = False
    cbs.on_train_begin()
    restored = compat.take_initial_epoch(model)  # by Keras's BackupAndRestore
    if restored:
        initial_step = max(initial_step, restored * steps_per_epoch)
    total = epochs * steps_per_epoch
    with plugin.tf_strategy.scope():
        # step s done <=> done_mask[s] == 1 (see _count)
        plugin.done_mask = tf.Variable(tf.cast(tf.range(total) < initial_step, tf.int8),
                                     trainable=False, name="tfdist_ps_done_mask")
    plugin.runs_loss.assign([initial_step, 0.0])
    model.optimizer.iterations.assign(initial_step // k)  # (updates: k steps each)
    from tfdist.callbacks import TrainingLog  # it records each worker's steps (a list)
    count = tf.function(lambda: _count(plugin))
    runs_and_loss = tf.function(lambda: plugin.runs_loss.read_value())
    loop = _Loop(plugin, model, cbs, _train_closure(plugin, model, data, k), steps_per_epoch,
                 log_every_steps or max(1, min(steps_per_epoch, 10)), initial_step,
                 worker_steps=any(isinstance(c, TrainingLog) for c in callbacks),
                 count=count, runs_and_loss=runs_and_loss, per_closure=k)
    for epoch in range(initial_step // steps_per_epoch, epochs):
        cbs.on_epoch_begin(epoch)
        model.reset_metrics()  # the compiled metrics: this epoch's, as Keras's fit keeps them
        epoch_logs = loop.run_epoch(epoch)
        if step_addressed(validation_data):
            epoch_logs["val_loss"] = _validate(plugin, model, validation_data, validation_steps)
        elif validation_data is not None:
            val = validation_data
            if isinstance(val, tuple):
                from tfdist.data.pipeline import from_arrays
                val = from_arrays(*(list(val) + [None])[:3], None, "validation_data")
            epoch_logs.update({f"val_{k}": v for k, v in plugin.evaluate(
                model, val, steps=validation_steps, verbose=0).items()})
        cbs.on_epoch_end(epoch, epoch_logs)  # tfdist's log adds val_bits_per_byte
        if model.stop_training:
            break
    cbs.on_train_end()
    return history


def _train_closure(plugin, model, data, k=1):
    """(the function a closure runs, its arguments for the closure starting at step s): one step
    each, or with `k` > 1 the k steps of an update."""
    from tfdist import compat
    strategy = plugin.tf_strategy
    runs_loss = plugin.runs_loss
    worker_steps = plugin.worker_steps
    done_mask = plugin.done_mask
    by_step = step_addressed(data)
    if by_step and getattr(data, "on_input", None):  # (the closures' input: data.batch(step))
        data.on_input(data, None)
    if not by_step:  # a dataset_fn, or a tf.data.Dataset: each worker reads its share
        if isinstance(data, tf.data.Dataset):
            from tfdist.data.pipeline import every_nth
            data = every_nth(data, plugin.num_workers,
                             tf.distribute.coordinator.experimental_get_current_worker_index)
        iterator = iter(plugin.coordinator.create_per_worker_dataset(data))

    def count(step, loss):
        done_mask.scatter_nd_update([[step]], tf.constant([1], tf.int8))  # idempotent
        runs_loss.assign_add(tf.stack([tf.constant(1.0, tf.float64), tf.cast(loss, tf.float64)]))
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        worker_steps.scatter_nd_add([[worker]], tf.constant([1], tf.int64))

    # The step functions return nothing. A returned tensor stays on the worker, and when the
    # coordinator drops it, its deletion is an RPC to that worker queued on the eager
    # context's default executor; every closure thread waits for that executor when it leaves
    # a closure (TF 2.21's `executor_scope` deletes a wrapper of it, whose `__del__` waits).
    # So a paused worker with a deletion in flight stalled every worker: 7 of 105 3-s SIGSTOPs
    # of worker 1 stopped worker 0 too; with nothing returned, 0 of 80 (found here; no upstream
    # issue found).
    @tf.function
    def train_by_step(step):
        def replica_fn(step):
            count(step, compat.train_step_loss(model, data.batch(step)))
        strategy.run(replica_fn, args=(step,))

    @tf.function
    def train_from_iterator(iterator, step):
        def replica_fn(batch, step):
            count(step, compat.train_step_loss(model, batch))
        strategy.run(replica_fn, args=(next(iterator), step))

    def window(batches, first):  # an update over k steps' batches, each step counted
        losses = compat.train_step_losses(model, lambda: model.train_step.update_over(batches))
        for i, loss in enumerate(losses):
            count(first + i, loss)

    @tf.function
    def train_window_by_step(first):
        strategy.run(lambda first: window([data.batch(first + i) for i in range(k)], first),
                     args=(first,))

    @tf.function
    def train_window_from_iterator(iterator, first):
        strategy.run(window, args=([next(iterator) for _ in range(k)], first))

    if by_step:
        fn = train_window_by_step if k > 1 else train_by_step
        return fn, lambda step: (tf.constant(step, tf.int64),)
    fn = train_window_from_iterator if k > 1 else train_from_iterator
    return fn, lambda step: (iterator, tf.constant(step, tf.int64))


def _count(plugin):
    """Steps done, each counted once (a closure retried after a worker failure may have run
    twice: TF's coordinator executes at least once). Summed on the ps that holds the mask."""
    with tf.device(plugin.done_mask.device):
        return tf.reduce_sum(tf.cast(plugin.done_mask, tf.int64))


def _validate(plugin, model, validation_data, steps):
    @tf.function
    def eval_step(step):
        def replica_fn(step):
            x, y = validation_data.batch(step)
            return model.compute_loss(x=x, y=y, y_pred=model(x, training=False))
        return plugin.tf_strategy.run(replica_fn, args=(step,))

    results = [plugin.coordinator.schedule(eval_step, args=(tf.constant(s, tf.int64),))
               for s in range(steps)]
    plugin.coordinator.join()
    return float(np.mean([r.fetch() for r in results]))


class _Loop:
    """The chief's loop over one epoch's steps: keeps steps in flight (`advance`), and every
    `every` completed steps reports to the callbacks: the mean loss of the steps run since the
    last report, how many steps that was, the steps each worker ran, and the compiled metrics.
    `count()`: the steps done, each once; `runs_and_loss()`: runs and their summed loss.
    `per_closure`: the steps a closure runs (an update's, under accumulation)."""

    def __init__(self, plugin, model, cbs, train_fn, steps_per_epoch, every, initial_step,
                 worker_steps, count, runs_and_loss, per_closure=1):
        self.plugin = plugin
        self.model = model
        self.cbs = cbs
        self.train_fn = train_fn
        self.worker_steps = worker_steps
        self.count = count
        self.runs_and_loss = runs_and_loss
        self.steps_per_epoch = steps_per_epoch
        self.every = every
        self.per_closure = per_closure
        self.done = initial_step  # steps completed
        self.scheduled = initial_step  # the next step to schedule
        self.backup_every = [c.every_steps for c in cbs.callbacks if getattr(c, "every_steps", 0)]
        # tfdist.runtime.preemption's callbacks
        self.preemption = [c for c in cbs.callbacks if hasattr(c, "received")]
        self.last_runs, self.last_loss_sum = (float(v) for v in runs_and_loss())
        self.loss = float("nan")

    def run_epoch(self, epoch):
        """Runs the rest of epoch `epoch`; returns its logs (the mean loss of its steps and the
        compiled metrics)."""
        from tfdist.callbacks import EXTRA_LOG_PREFIX, STEPS_KEY
        p = self.plugin
        end = (epoch + 1) * self.steps_per_epoch
        epoch_runs, epoch_loss_sum = self.last_runs, self.last_loss_sum
        while self.done < end:
            self.cbs.on_train_batch_begin(self.done % self.steps_per_epoch)
            target = min(self.done + self.every, end)
            barrier = target == end or any(target // b > self.done // b for b in self.backup_every)
            self.scheduled = self.advance(target, end, barrier)
            if any(c.received for c in self.preemption):
                # signalled: drain the steps in flight, so that the backup it writes now holds
                # them all
                p.coordinator.join()
            now = int(self.count())  # >= target: steps in flight may have finished too
            runs, loss_sum = (float(v) for v in self.runs_and_loss())
            # the mean loss of the runs since the last report (steps still in flight at that
            # report may all have finished by then: keep the last mean)
            if runs > self.last_runs:
                self.loss = (loss_sum - self.last_loss_sum) / (runs - self.last_runs)
            n = now - self.done
            self.done = now
            self.last_loss_sum = loss_sum
            self.last_runs = runs
            # the exact count of updates (module doc)
            self.model.optimizer.iterations.assign(self.done // self.per_closure)
            logs = {**self.metrics(), "loss": self.loss, STEPS_KEY: n}
            # the steps run by each worker so far (not a scalar: only for tfdist's log; Keras's
            # TensorBoard would write it as one)
            if self.worker_steps:
                logs[EXTRA_LOG_PREFIX + "worker_steps"] = p.worker_steps.numpy().tolist()
            self.cbs.on_train_batch_end((self.done - 1) % self.steps_per_epoch, logs)
            if self.model.stop_training:  # (a loss spike's watch, say): the epoch ends here,
                p.coordinator.join()  # as in Keras's fit, once the steps in flight are done
                break
        mean = (self.last_loss_sum - epoch_loss_sum) / max(self.last_runs - epoch_runs, 1)
        return {**self.metrics(), "loss": mean}

    def advance(self, target, end, barrier):
        """Keeps up to 2 x workers steps in flight until `target` steps have completed.
        With `barrier`, also waits for every step in flight (a consistent state to save).
        Returns the next step to schedule."""
        from tfdist import compat
        coordinator = self.plugin.coordinator
        scheduled = self.scheduled
        k = self.per_closure
        window = 2 * self.plugin.num_workers * k  # steps in flight: 2 closures a worker
        while True:
            # completed so far: a local read of the coordinator's queue (polling a counter on
            # the ps would cost the ps and the chief about a quarter core each)
            done = scheduled - k * compat.pending_closures(coordinator)
            limit = target if barrier else end
            while scheduled < limit and scheduled - done < window:
                fn, args = self.train_fn
                coordinator.schedule(fn, args=args(scheduled))
                scheduled += k
            if barrier and scheduled >= target:
                coordinator.join()
                break
            if done >= target and int(self.count()) >= target:
                break
            coordinator.done()  # raises the error of any failed step (else we'd wait forever)
            time.sleep(0.005)
        return scheduled

    def metrics(self):
        """The compiled metrics (accuracy, ...) of the steps since their reset, read from the ps
        (the workers' train steps update them there); the loss is counted exactly instead."""
        return {k: v for k, v in logs_of(self.model).items() if k != "loss" and np.ndim(v) == 0}


def step_addressed(data):
    """tfdist.data.Windows and the like: batch(step) gives the batch of any global step."""
    return (not isinstance(data, tf.data.Dataset) and hasattr(data, "batch")
            and hasattr(data, "dataset_fn"))


def logs_of(model):
    """The model's metrics now, as Keras logs them."""
    return {k: float(v) if np.ndim(v) == 0 else np.asarray(v)
            for k, v in model.get_metrics_result().items()}
