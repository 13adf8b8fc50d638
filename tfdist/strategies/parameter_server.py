"""`parameter_server`: asynchronous data parallelism. Variables on ps tasks, steps on workers.

Keras 3 `fit` does not support ParameterServerStrategy (keras-team/keras#18624). This plugin runs
`fit` as a `tf.distribute.coordinator.ClusterCoordinator` loop on the chief (the coordinator):
every step is a closure scheduled on whichever worker is free, at most `2 x workers` in flight.
tfdist's data is addressed by step, so each batch is trained on once, also when a closure runs
again after a worker failure (a plain `tf.data.Dataset`: worker w reads batches w, w + N, ...).
The step count is exact: each step marks itself done in a mask on the ps, and `iterations` is set
from that count at every report (Keras 3's `assign_add` loses increments under concurrency).
Callbacks run every 10 completed steps (`logs["tfdist/steps"]` says how many); before a backup,
at each epoch end and after a preemption signal the loop waits for every step in flight, so a
backup holds exactly the steps counted. `evaluate` and `predict` send each batch to a free worker
and compute the loss and metrics here, in order. Worker and ps tasks only serve: building the
plugin there serves until the chief is gone, then ends the process. In depth:
docs/strategies.md, "parameter_server".

Usage (not run as a doctest: a chief with TF_CONFIG listing chief, worker and ps tasks):

    strategy = tfdist.strategies.get("parameter_server")   # on a worker or ps task: serves here
    with strategy.scope():
        model = ...; model.compile(optimizer="adam", loss=...)
    model.fit(dataset, epochs=2, steps_per_epoch=100)     # steps_per_epoch is required
    model.evaluate(val_dataset); model.predict(test_dataset)
"""
import os
import sys
import time

import numpy as np

from tfdist import cluster as cluster_lib
from tfdist.errors import UsageError
from tfdist.lazy import keras, tf
from tfdist.strategies.base import Launch, Strategy

_ROLES = ("chief", "worker", "ps")


class ParameterServer(Strategy):
    name = "parameter_server"
    supports_jit_compile = False
    # A chief (the coordinator), workers and ps tasks. A dead worker is restarted alone and
    # rejoins (asynchronous training goes on without it); the servers run until stopped.
    launch = Launch(roles=_ROLES, restart_alone=("worker",), servers=("worker", "ps"),
                    server_module="tfdist.launch.serve", elastic="it already trains on with the "
                    "workers it has (a lost worker's steps run on the others; it is restarted alone)")
    options = {
        "keepalive_secs": (5.0, lambda v: v == 0 or 1 <= v <= 3600,
                           "0 (off) or a number of seconds in [1, 3600]: gRPC keepalive pings "
                           "while a step is in flight, so a worker cut off is noticed"),
    }

    def __init__(self, cluster=None, keepalive_secs=5.0, **unused_options):
        cluster_lib.grpc_keepalive(keepalive_secs)
        self.cluster = cluster or cluster_lib.from_environment(allowed_roles=_ROLES)
        if self.cluster is None:
            raise UsageError("parameter_server needs a cluster with chief, worker and ps tasks: set "
                             "TF_CONFIG or start it with `tfdist launch --strategy=parameter_server`")
        missing = [r for r in _ROLES if r not in self.cluster.cluster]
        if missing:
            raise UsageError(f"parameter_server needs {', '.join(missing)} task(s) in the cluster "
                             f"(it has {', '.join(self.cluster.cluster)})")
        self.coordinator = None
        if self.cluster.task_type != "chief":
            super().__init__(tf.distribute.get_strategy())
            self.serve()  # a worker or ps task serves; its program goes no further
        cluster_lib.wait_for_tasks(self.cluster.cluster, ("ps", "worker"), float(os.environ.get(
            "TFDIST_PS_CONNECT_TIMEOUT", self.CONNECT_TIMEOUT)), "tfdist launch "
            "--strategy=parameter_server starts them all")
        # No variable_partitioner: Keras 3.15 hands `tape.gradient` a variable's `.handle`, which a
        # ShardedVariable lacks ("'ShardedVariable' object has no attribute 'handle'").
        super().__init__(tf.distribute.ParameterServerStrategy(self.cluster.resolver()))
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.tf_strategy)
        with self.tf_strategy.scope():
            self.runs = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_ps_runs")
            self.worker_steps = tf.Variable(tf.zeros([self.num_workers], tf.int64),
                                            trainable=False, name="tfdist_ps_worker_steps")
            self.loss_sum = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                        name="tfdist_ps_loss_sum")

    # -- who am I ------------------------------------------------------------------------------
    @property
    def is_chief(self):
        return self.cluster.task_type == "chief"

    @property
    def worker_index(self):
        return self.cluster.task_index if self.cluster.task_type == "worker" else 0

    @property
    def num_workers(self):
        return len(self.cluster.cluster["worker"])

    @property
    def num_replicas(self):
        return 1  # each closure trains on one whole batch

    @property
    def is_server(self):
        return self.cluster.task_type != "chief"

    def describe(self):
        c = self.cluster.cluster
        return (f"{self.name}: coordinator of {len(c['worker'])} worker(s) and {len(c['ps'])} ps "
                f"task(s), asynchronous")

    ORPHAN_TIMEOUT = 60.0  # seconds; TFDIST_SERVER_ORPHAN_TIMEOUT overrides
    CONNECT_TIMEOUT = 45.0  # the chief's wait for every task to listen; TFDIST_PS_CONNECT_TIMEOUT

    def serve(self):
        """On a worker or ps task: serves, then ends the process (TF's server threads would keep
        it alive) once the chief, after having been up, has been unreachable for ORPHAN_TIMEOUT
        seconds (under Slurm or by hand nothing else ends a server). After a preemption signal it
        serves on while the chief drains and saves, until the chief is gone (exit 75). On the
        chief: returns."""
        if self.cluster.task_type == "chief":
            return
        code = cluster_lib.serve_until_chief_gone(self.cluster, float(os.environ.get(
            "TFDIST_SERVER_ORPHAN_TIMEOUT", self.ORPHAN_TIMEOUT)))
        sys.stdout.flush()
        os._exit(code)

    # -- a user's Keras program --------------------------------------------------------------
    def keras_call(self, method, model, upstream, arguments):
        """Keras 3 has no ParameterServerStrategy path (keras-team/keras#18624): `fit` is the
        coordinator loop, `evaluate` and `predict` schedule their batches on the workers."""
        from tfdist import compat
        from tfdist.data.pipeline import from_arrays
        a = arguments
        if method in ("fit", "evaluate", "predict"):
            compat.build_for(model, a["x"])  # here: a worker cannot create the variables
        if method == "fit":
            if a["y"] is not None or not (isinstance(a["x"], tf.data.Dataset) or callable(a["x"])
                                          or _step_addressed(a["x"])):
                raise UsageError("under parameter_server, fit takes a tf.data.Dataset (or a "
                                 "dataset_fn) of (x, y) batches, not arrays")
            return self.fit(model, a["x"], epochs=a["epochs"], steps_per_epoch=a["steps_per_epoch"],
                            initial_step=a["initial_epoch"] * (a["steps_per_epoch"] or 0),
                            callbacks=a["callbacks"], validation_data=a["validation_data"],
                            validation_steps=a["validation_steps"], verbose=a["verbose"])
        if method == "evaluate":
            logs = self.evaluate(model, from_arrays(a["x"], a["y"], a["sample_weight"],
                                                    a["batch_size"], "evaluate under parameter_server"),
                                 steps=a["steps"], callbacks=a["callbacks"], verbose=a["verbose"])
            return logs if a["return_dict"] else compat.flatten_metrics(model, logs)
        if method == "predict":
            return self.predict(model, from_arrays(a["x"], None, None, a["batch_size"], "predict under parameter_server"),
                                steps=a["steps"], callbacks=a["callbacks"], verbose=a["verbose"])
        return super().keras_call(method, model, upstream, arguments)

    def evaluate(self, model, dataset, steps=None, callbacks=None, verbose="auto"):
        """Keras `evaluate`: the forward passes on the workers, the loss and metrics here, in
        one place (exact). Returns the logs."""
        return self._on_workers("test", model, dataset, steps, callbacks, verbose)

    def predict(self, model, dataset, steps=None, callbacks=None, verbose="auto"):
        """Keras `predict`: the batches' outputs computed on the workers, in the dataset's order."""
        return self._on_workers("predict", model, dataset, steps, callbacks, verbose)

    def _on_workers(self, mode, model, dataset, steps, callbacks, verbose):
        """Each batch (at most `steps`) goes to a free worker, which returns the model's outputs
        (at most 2 x workers in flight); they are taken here in the dataset's order."""
        from tfdist import compat
        cbs = keras.callbacks.CallbackList(callbacks, add_progbar=verbose not in (0, False),
                                           verbose=verbose, model=model, epochs=1, steps=steps)
        forward = tf.function(lambda x: self.tf_strategy.run(
            lambda x: model(x, training=False), args=(x,)))
        model.reset_metrics()
        getattr(cbs, f"on_{mode}_begin")()
        outputs, pending = [], []

        def take(index, batch, y_pred):
            getattr(cbs, f"on_{mode}_batch_begin")(index)
            if mode == "test":
                x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
                compat.test_step_given(model, x, y, y_pred, sample_weight)
            outputs.append(y_pred)
            getattr(cbs, f"on_{mode}_batch_end")(index, _logs(model) if mode == "test"
                                                 else {"outputs": y_pred})

        for index, batch in enumerate(dataset.take(steps) if steps else dataset):
            x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
            pending.append((index, batch, self.coordinator.schedule(forward, args=(x,))))
            if len(pending) >= 2 * self.num_workers:
                index, batch, y_pred = pending.pop(0)
                take(index, batch, y_pred.fetch())
        for index, batch, y_pred in pending:
            take(index, batch, y_pred.fetch())
        if mode == "test":
            logs = _logs(model)
            cbs.on_test_end(logs)
            return logs
        cbs.on_predict_end()
        return tf.nest.map_structure(lambda *rows: np.concatenate(rows), *outputs)

    # -- training ------------------------------------------------------------------------------
    def fit(self, model, data, *, epochs=1, steps_per_epoch=None, initial_step=0, callbacks=None,
            validation_data=None, validation_steps=None, verbose="auto", log_every_steps=None,
            strategy_callbacks=None, progress_every=1):
        """The coordinator loop (see the module doc). `data` is a `Windows`-like object with
        `batch(step)`, or a `tf.data.Dataset` / `dataset_fn()` read through per-worker datasets."""
        from tfdist import compat
        if not steps_per_epoch:
            raise UsageError("parameter_server training needs steps_per_epoch (there is no end of "
                             "data to detect: each worker reads its own copy); pass steps_per_epoch")
        if hasattr(data, "dataset_fn") and not _step_addressed(data):
            raise UsageError("parameter_server needs step-addressed data (with batch(step)) or a "
                             "tf.data.Dataset")
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
        with self.tf_strategy.scope():  # step s done <=> done_mask[s] == 1 (see _count)
            self.done_mask = tf.Variable(tf.cast(tf.range(total) < initial_step, tf.int8),
                                         trainable=False, name="tfdist_ps_done_mask")
        self.runs.assign(initial_step)
        model.optimizer.iterations.assign(initial_step)
        from tfdist.callbacks import TrainingLog  # it records each worker's steps (a list)
        loop = _Loop(self, model, cbs, self._train_closure(model, data), steps_per_epoch,
                     log_every_steps or max(1, min(steps_per_epoch, 10)), initial_step,
                     worker_steps=any(isinstance(c, TrainingLog) for c in callbacks),
                     count=tf.function(self._count_fn), runs_and_loss=tf.function(
                         lambda: (self.runs.read_value(), self.loss_sum.read_value())))
        for epoch in range(initial_step // steps_per_epoch, epochs):
            cbs.on_epoch_begin(epoch)
            model.reset_metrics()  # the compiled metrics: this epoch's, as Keras's fit keeps them
            epoch_logs = loop.run_epoch(epoch)
            if _step_addressed(validation_data):
                epoch_logs["val_loss"] = self._validate(model, validation_data, validation_steps)
            elif validation_data is not None:
                val = validation_data
                if isinstance(val, tuple):
                    from tfdist.data.pipeline import from_arrays
                    val = from_arrays(*(list(val) + [None])[:3], None, "validation_data")
                epoch_logs.update({f"val_{k}": v for k, v in self.evaluate(
                    model, val, steps=validation_steps, verbose=0).items()})
            cbs.on_epoch_end(epoch, epoch_logs)  # tfdist's log adds val_bits_per_byte
            if model.stop_training:
                break
        cbs.on_train_end()
        return history

    def _train_closure(self, model, data):
        from tfdist import compat
        strategy, runs, worker_steps = self.tf_strategy, self.runs, self.worker_steps
        done_mask = self.done_mask
        by_step = _step_addressed(data)
        if not by_step:  # a dataset_fn, or a tf.data.Dataset: each worker reads its share
            if isinstance(data, tf.data.Dataset):
                from tfdist.data.pipeline import every_nth
                data = every_nth(data, self.num_workers,
                                 tf.distribute.coordinator.experimental_get_current_worker_index)
            iterator = iter(self.coordinator.create_per_worker_dataset(data))

        loss_sum = self.loss_sum

        def count(step, loss):
            done_mask.scatter_nd_update([[step]], tf.constant([1], tf.int8))  # idempotent
            loss_sum.assign_add(tf.cast(loss, tf.float64))
            runs.assign_add(1)
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

        if by_step:
            return train_by_step, lambda step: (tf.constant(step, tf.int64),)
        return train_from_iterator, lambda step: (iterator, tf.constant(step, tf.int64))

    def _count_fn(self):
        """Steps done, each counted once (a closure retried after a worker failure may have run
        twice: TF's coordinator executes at least once). Summed on the ps that holds the mask."""
        with tf.device(self.done_mask.device):
            return tf.reduce_sum(tf.cast(self.done_mask, tf.int64))

    def _validate(self, model, validation_data, steps):
        @tf.function
        def eval_step(step):
            def replica_fn(step):
                x, y = validation_data.batch(step)
                return model.compute_loss(x=x, y=y, y_pred=model(x, training=False))
            return self.tf_strategy.run(replica_fn, args=(step,))

        results = [self.coordinator.schedule(eval_step, args=(tf.constant(s, tf.int64),))
                   for s in range(steps)]
        self.coordinator.join()
        return float(np.mean([r.fetch() for r in results]))


class _Loop:
    """The chief's loop over one epoch's steps: keeps steps in flight (`advance`), and every
    `every` completed steps reports to the callbacks: the mean loss of the steps run since the
    last report, how many steps that was, the steps each worker ran, and the compiled metrics.
    `count()`: the steps done, each once; `runs_and_loss()`: runs and their summed loss."""

    def __init__(self, plugin, model, cbs, train_fn, steps_per_epoch, every, initial_step,
                 worker_steps, count, runs_and_loss):
        self.plugin, self.model, self.cbs, self.train_fn = plugin, model, cbs, train_fn
        self.worker_steps, self.count, self.runs_and_loss = worker_steps, count, runs_and_loss
        self.steps_per_epoch, self.every = steps_per_epoch, every
        self.done = self.scheduled = initial_step
        self.backup_every = [c.every_steps for c in cbs.callbacks if getattr(c, "every_steps", 0)]
        self.preemption = [c for c in cbs.callbacks if hasattr(c, "received")]  # tfdist.preemption
        self.last_runs, self.last_loss_sum = (float(v) for v in runs_and_loss())
        self.loss = float("nan")

    def run_epoch(self, epoch):
        """Runs the rest of epoch `epoch`; returns its logs (the mean loss of its steps and the
        compiled metrics)."""
        from tfdist.callbacks import EXTRA_LOG_PREFIX, STEPS_KEY
        p, end = self.plugin, (epoch + 1) * self.steps_per_epoch
        epoch_runs, epoch_loss_sum = self.last_runs, self.last_loss_sum
        while self.done < end:
            self.cbs.on_train_batch_begin(self.done % self.steps_per_epoch)
            target = min(self.done + self.every, end)
            barrier = target == end or any(target // b > self.done // b for b in self.backup_every)
            self.scheduled = self.advance(target, end, barrier)
            if any(c.received for c in self.preemption):  # signalled: drain the steps in flight,
                p.coordinator.join()  # so that the backup it writes now holds them all
            now = int(self.count())  # >= target: steps in flight may have finished too
            runs, loss_sum = (float(v) for v in self.runs_and_loss())
            if runs > self.last_runs:  # mean loss of the runs since the last report (steps still
                # in flight at that report may all have finished by then: keep the last mean)
                self.loss = (loss_sum - self.last_loss_sum) / (runs - self.last_runs)
            n, self.done, self.last_loss_sum, self.last_runs = now - self.done, now, loss_sum, runs
            self.model.optimizer.iterations.assign(self.done)  # the exact count (module doc)
            logs = {**self.metrics(), "loss": self.loss, STEPS_KEY: n}
            if self.worker_steps:  # steps run by each worker so far (not a scalar: only for
                # tfdist's log; Keras's TensorBoard would write it as one)
                logs[EXTRA_LOG_PREFIX + "worker_steps"] = p.worker_steps.numpy().tolist()
            self.cbs.on_train_batch_end((self.done - 1) % self.steps_per_epoch, logs)
        mean = (self.last_loss_sum - epoch_loss_sum) / max(self.last_runs - epoch_runs, 1)
        return {**self.metrics(), "loss": mean}

    def advance(self, target, end, barrier):
        """Keeps up to 2 x workers steps in flight until `target` steps have completed.
        With `barrier`, also waits for every step in flight (a consistent state to save).
        Returns the next step to schedule."""
        from tfdist import compat
        coordinator, scheduled = self.plugin.coordinator, self.scheduled
        window = 2 * self.plugin.num_workers
        while True:
            # completed so far: a local read of the coordinator's queue (polling a counter on
            # the ps would cost the ps and the chief about a quarter core each)
            done = scheduled - compat.pending_closures(coordinator)
            limit = target if barrier else end
            while scheduled < limit and scheduled - done < window:
                fn, args = self.train_fn
                coordinator.schedule(fn, args=args(scheduled))
                scheduled += 1
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
        return {k: v for k, v in _logs(self.model).items() if k != "loss" and np.ndim(v) == 0}


def _step_addressed(data):
    """tfdist.data.Windows and the like: batch(step) gives the batch of any global step."""
    return (not isinstance(data, tf.data.Dataset) and hasattr(data, "batch")
            and hasattr(data, "dataset_fn"))


def _logs(model):  # the model's metrics now, as Keras logs them
    return {k: float(v) if np.ndim(v) == 0 else np.asarray(v)
            for k, v in model.get_metrics_result().items()}
