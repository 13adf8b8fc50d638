"""`parameter_server`: asynchronous data parallelism. Variables on ps tasks, steps on workers.

Keras 3 `fit` does not support ParameterServerStrategy (keras-team/keras#18624). This plugin runs
`fit` as a `tf.distribute.coordinator.ClusterCoordinator` loop on the chief (the coordinator:
`tfdist.strategies.parameter_server.loop`), every step a closure scheduled on whichever worker is
free. `evaluate` and `predict` send each batch to a free worker and compute the loss and metrics
here, in order. Worker and ps tasks only serve: building the plugin there serves until the chief
is gone, then ends the process. In depth: docs/strategies.md, "parameter_server".

Usage (not run as a doctest: a chief with TF_CONFIG listing chief, worker and ps tasks):

    strategy = tfdist.strategies.get("parameter_server")   # on a worker or ps task: serves here
    with strategy.scope():
        model = ...
        model.compile(optimizer="adam", loss=...)
    model.fit(dataset, epochs=2, steps_per_epoch=100)     # steps_per_epoch is required
    model.evaluate(val_dataset)
    model.predict(test_dataset)
"""
import atexit
import os
import sys

import numpy as np

from tfdist.errors import UsageError
from tfdist.runtime import cluster as cluster_lib
from tfdist.runtime.lazy import keras, tf
from tfdist.strategies.base import Launch, Strategy
from tfdist.strategies.parameter_server import loop

_ROLES = ("chief", "worker", "ps")


_STATUS = []  # the chief's exit status, as recorded (`_end_without_remote_teardown`)


def _end_without_remote_teardown():
    """At its exit, the chief's process ends with its status once Python's exit handlers and
    logging have run, before TF tears its eager context down. That teardown removes every
    function from every worker by RPC, and a worker cut off answers each one only by gRPC's ping
    timeout (72 s measured, 2 workers SIGSTOPped at the end; without end under a partition that
    keeps the connection up): it is where the chief hung (in `ClusterCoordinator.__del__` and
    the context's destructor). The workers and ps tasks need none of it: they end when the chief
    is gone (`serve`). The status: what `sys.exit` was given, 1 after an uncaught exception,
    else 0. `TFDIST_PS_EXIT=teardown` keeps TF's teardown (a companion test's)."""
    if _STATUS or os.environ.get("TFDIST_PS_EXIT") == "teardown":
        return
    _STATUS.append(0)
    exit_, excepthook = sys.exit, sys.excepthook

    def recording_exit(code=0):
        _STATUS[0] = code if isinstance(code, int) else (0 if code is None else 1)
        exit_(code)

    def recording_hook(*exc):
        _STATUS[0] = 1
        excepthook(*exc)
    sys.exit, sys.excepthook = recording_exit, recording_hook

    def end():  # registered first, so it runs last of the exit handlers (LIFO)
        import logging
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(_STATUS[0])
    atexit.register(end)


class ParameterServer(Strategy):
    name = "parameter_server"
    supports_jit_compile = False
    updates_together = False  # (no skip_nonfinite)
    # A chief (the coordinator), workers and ps tasks. A dead worker is restarted alone and
    # rejoins (asynchronous training goes on without it); the servers run until stopped.
    launch = Launch(roles=_ROLES, restart_alone=("worker",), servers=("worker", "ps"),
                    server_module="tfdist.cli.serve",
                    recovery="its state lives on the ps tasks, and a lost worker is restarted "
                             "alone while the others train on (its steps run on them)",
                    elastic="it already trains on with the workers it has (a lost worker's "
                            "steps run on the others; it is restarted alone)",
                    ray=None)
    options = {
        "keepalive_secs": (5.0, lambda v: v == 0 or 1 <= v <= 3600,
                           "0 (off) or a number of seconds in [1, 3600]: gRPC keepalive pings "
                           "while a step is in flight, so a worker cut off is noticed"),
    }

    def __init__(self, cluster=None, keepalive_secs=5.0, **unused_options):
        cluster_lib.grpc_keepalive(keepalive_secs)
        self.cluster = cluster or cluster_lib.from_environment(allowed_roles=_ROLES)
        if self.cluster is None:
            raise UsageError("parameter_server needs a cluster with chief, worker and ps tasks: "
                             "set TF_CONFIG or start it with "
                             "`tfdist launch --strategy=parameter_server`")
        missing = [r for r in _ROLES if r not in self.cluster.cluster]
        if missing:
            raise UsageError(f"parameter_server needs {', '.join(missing)} task(s) in the cluster "
                             f"(it has {', '.join(self.cluster.cluster)})")
        self.coordinator = None
        if self.cluster.task_type != "chief":
            super().__init__(tf.distribute.get_strategy())
            self.serve()  # a worker or ps task serves; its program goes no further
        timeout = float(os.environ.get("TFDIST_PS_CONNECT_TIMEOUT", self.CONNECT_TIMEOUT))
        cluster_lib.wait_for_tasks(self.cluster.cluster, ("ps", "worker"), timeout,
                                   "tfdist launch --strategy=parameter_server starts them all")
        # No variable_partitioner: Keras 3.15 hands `tape.gradient` a variable's `.handle`, which a
        # ShardedVariable lacks ("'ShardedVariable' object has no attribute 'handle'").
        super().__init__(tf.distribute.ParameterServerStrategy(self.cluster.resolver()))
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.tf_strategy)
        _end_without_remote_teardown()
        with self.tf_strategy.scope():
            # [steps run, their summed loss]: one variable, so that a read sees both of one
            # closure's updates or neither (two variables, read while closures ran, had the
            # reported mean loss off by a tenth of a step's loss, about 0.3, every other report)
            self.runs_loss = tf.Variable(tf.zeros([2], tf.float64), trainable=False,
                                         name="tfdist_ps_runs_loss")
            self.worker_steps = tf.Variable(tf.zeros([self.num_workers], tf.int64),
                                            trainable=False, name="tfdist_ps_worker_steps")

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

    @classmethod
    def start_server(cls, spec, keepalive_secs=5.0, **unused_options):
        """This worker or ps task's server (`spec`: its ClusterSpec), started as `serve` starts
        it, for a launcher that learns itself when the job is over (`tfdist launch --engine=ray`:
        tfdist/launch/ray_roles.py). It serves while the returned object lives."""
        cluster_lib.grpc_keepalive(keepalive_secs)
        return cluster_lib.start_server(spec)

    def serve(self):
        """On a worker or ps task: serves, then ends the process (TF's server threads would keep
        it alive) once the chief, after having been up, has been unreachable for ORPHAN_TIMEOUT
        seconds (under Slurm or by hand nothing else ends a server). After a preemption signal it
        serves on while the chief drains and saves, until the chief is gone (exit 75). On the
        chief: returns."""
        if self.cluster.task_type == "chief":
            return
        timeout = float(os.environ.get("TFDIST_SERVER_ORPHAN_TIMEOUT", self.ORPHAN_TIMEOUT))
        code = cluster_lib.serve_until_chief_gone(self.cluster, timeout)
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
                                          or loop.step_addressed(a["x"])):
                raise UsageError("under parameter_server, fit takes a tf.data.Dataset (or a "
                                 "dataset_fn) of (x, y) batches, not arrays")
            self.stepped(model, method, a)  # an optimizer that accumulates: tfdist's step
            return self.fit(model, a["x"], epochs=a["epochs"], steps_per_epoch=a["steps_per_epoch"],
                            initial_step=a["initial_epoch"] * (a["steps_per_epoch"] or 0),
                            callbacks=a["callbacks"], validation_data=a["validation_data"],
                            validation_steps=a["validation_steps"], verbose=a["verbose"])
        if method == "evaluate":
            dataset = from_arrays(a["x"], a["y"], a["sample_weight"], a["batch_size"],
                                  "evaluate under parameter_server")
            logs = self.evaluate(model, dataset, steps=a["steps"], callbacks=a["callbacks"],
                                 verbose=a["verbose"])
            return logs if a["return_dict"] else compat.flatten_metrics(model, logs)
        if method == "predict":
            dataset = from_arrays(a["x"], None, None, a["batch_size"],
                                  "predict under parameter_server")
            return self.predict(model, dataset, steps=a["steps"], callbacks=a["callbacks"],
                                verbose=a["verbose"])
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
        outputs = []
        pending = []  # (index, batch, the worker's result to come)

        def take(index, batch, y_pred):
            getattr(cbs, f"on_{mode}_batch_begin")(index)
            if mode == "test":
                x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
                compat.test_step_given(model, x, y, y_pred, sample_weight)
            outputs.append(y_pred)
            getattr(cbs, f"on_{mode}_batch_end")(index, loop.logs_of(model) if mode == "test"
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
            logs = loop.logs_of(model)
            cbs.on_test_end(logs)
            return logs
        cbs.on_predict_end()
        return tf.nest.map_structure(lambda *rows: np.concatenate(rows), *outputs)

    # -- training: the coordinator loop (tfdist.strategies.parameter_server.loop) --------------
    def fit(self, model, data, **kwargs):
        """Keras's `fit` as the coordinator loop (see `loop.fit`)."""
        return loop.fit(self, model, data, **kwargs)

