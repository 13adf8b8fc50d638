"""The protocol every strategy plugin implements: one file per strategy owns all its behaviour.

A plugin wraps one `tf.distribute.Strategy`. What it does at run time:

* `scope()`: create the model, its variables and the optimizer under it;
* `num_replicas`, `is_chief`, `worker_index`, `num_workers`: batch sizing, logging and who writes
  checkpoints;
* `distribute(dataset_fn)`: per-replica input through `tf.distribute.InputContext`;
* `reduce_gradients(grads_and_vars)`: its collective, the gradients summed over the replicas
  (called by tfdist's training step, `tfdist.step`); `zero_collectives()`: ZeRO's;
* `prepare_optimizer(optimizer)` and `callbacks()`: what the strategy adds to training (Horovod:
  learning-rate scaling, an initial broadcast);
* `fit(model, data, ...)`: Keras `model.fit`, in segments so that training can resume at any step.
  A plugin overrides it only when its strategy cannot use Keras `fit` (parameter server);
* `serve()`: what a server task does (parameter server: serve until stopped, then end).

A user's own Keras program needs none of that: `model.compile(...)` inside `scope()` hands the
model to its plugin, and from then on Keras's `compile`, `fit`, `evaluate`, `predict` and `save`
go through `keras_call` (one mechanism for every strategy, `tfdist.compat.route_keras`). The
plugin adds its gradient handling to the compiled optimizer (also an optimizer given as a string),
its callbacks, its split of plain datasets, and lets only the chief write files.

What it declares, so that the layout (`tfdist.parallel.layout`, which judges what a strategy can
combine), `tfdist launch` and `tfdist plan` ask it instead of comparing names: `options` (its
config keys with default, rule and help: they join the config schema), `recommended` config values,
`uses_local_devices`, `supports_pipeline`, `supports_jit_compile`,
`zero_collectives`, `dp_collectives`, `collective_checkpoints`, `launch` (a `Launch`: roles,
restart policy, server tasks, rendezvous) and `plan_command` (the planner's command line).

Example (any registered strategy; see `tfdist.strategies.names()`):

    >>> import keras, tensorflow as tf, tfdist.strategies
    >>> strategy = tfdist.strategies.get("single")
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> ds = tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.ones((8, 1)))).repeat()
    >>> history = strategy.fit(model, ds, epochs=2, steps_per_epoch=5, verbose=0)
    >>> len(history.history["loss"])
    2
"""
import contextlib
import dataclasses

from tfdist.errors import PeerLost, UsageError
from tfdist.runtime.lazy import (
    tf,  # a plugin is read without TensorFlow (the registry, the planner)
)
from tfdist.strategies.keras_program import KerasProgram


@dataclasses.dataclass(frozen=True)
class Launch:
    """How `tfdist launch` starts a strategy's processes on one machine.

    `roles`: the task types of its cluster, the first one the chief (its exit 0 ends the run).
    `restart_alone`: roles whose dead task is restarted alone; any other failure restarts the
    whole group (abort and restart, for synchronous training). `servers`: roles that serve until
    stopped, stopped as soon as the chief is done. `rendezvous`: None for TF_CONFIG, else a
    class whose instance gives each task its place instead (Horovod's rank variables:
    `start(addresses, interfaces, here)` -> a dict of variables per task, `stop()`).
    `server_module`: a module that serves (`python -m <it> <strategy>`:
    `tfdist.cli.serve`), run on the `servers` when the launched command is a user's own program,
    so that it runs on the chief only.
    `elastic`: None if the group can change size while the job runs (`tfdist.launch.elastic`),
    else what this strategy does instead, said when asked to resize. `ray`: None if its workers
    run as Ray Train workers (`tfdist launch --engine=ray`: `tfdist.launch.ray_train`), else why
    not, said when asked; `ray_backend`: how Ray Train readies its workers there: "tensorflow"
    (TF_CONFIG of its `roles`, rank 0 the chief, the `servers` only serving with
    `Strategy.start_server`: `tfdist.launch.ray_roles`) or "horovod_gloo" (Horovod's rendezvous,
    `tfdist.launch.ray_horovod`).
    `recovery`: None if its group restarts from its processes' memory (each process's snapshots
    in its host's keeper: `tfdist.callbacks.memory`) and a spare can take a lost host's place
    (`tfdist launch --spares`), else why not, said when asked.
    """
    roles: tuple = ("worker",)
    restart_alone: tuple = ()
    servers: tuple = ()
    rendezvous: object = None
    server_module: str = None
    elastic: str = "it runs a fixed group"
    ray: str = "its processes are not Ray Train workers"
    ray_backend: str = "tensorflow"
    recovery: str = "its processes are not one synchronous group"


class Strategy(KerasProgram):
    """Base plugin: one replica on the default device. Subclasses set `self.tf_strategy`.

    Everything tfdist's training, launcher and planner need to know of a strategy is declared
    here, with defaults, and overridden by the plugin that differs; nothing outside
    `tfdist/strategies/` compares strategy names.
    """

    name = "base"
    #: Keras `jit_compile=True` works under this strategy (it does not under Mirrored on TF 2.21).
    supports_jit_compile = True
    #: Its replicas are this machine's devices, so a pipeline cannot have them for its stages.
    uses_local_devices = False
    #: A pipeline's stages can be placed on devices of its process.
    supports_pipeline = True
    #: Config values it recommends ("section.key" -> value), applied by `tfdist train` where the
    #: config keeps tfdist's defaults.
    recommended = {}
    #: Its own keys of `config.strategy`: key -> (default, check(value) -> bool, what is valid).
    #: Passed to the constructor by `tfdist.strategies.from_config`.
    options = {}
    #: How `tfdist launch` starts it (None: it cannot; start it by hand or with its own tool).
    launch = None

    #: It owns every model compiled in its process, inside its scope or not (Horovod: a process
    #: is one rank).
    process_wide = False

    def __init__(self, tf_strategy=None, **unused_options):
        self.tf_strategy = tf_strategy or tf.distribute.get_strategy()
        self.adopt_keras_models()  # a user's model compiled in its scope is this plugin's

    @classmethod
    def check_options(cls, options):
        """Raises UsageError, one line, for the first of its options with a bad value."""
        for key, (_, check, what) in cls.options.items():
            if key in options:
                try:
                    ok = check(options[key])
                except TypeError:
                    ok = False
                if not ok:
                    raise UsageError(f"config key 'strategy.{key}' must be {what} for strategy "
                                     f"{cls.name}, got {options[key]!r}")

    @classmethod
    def start_server(cls, spec, **options):
        """A server task's (`Launch.servers`) server, started as this strategy's server tasks
        start it, for a launcher that ends it itself; it serves while the returned object
        lives."""
        raise NotImplementedError(f"strategy {cls.name} has no server tasks")

    @classmethod
    def plan_command(cls, device, processes, per_node, flags):
        """For `tfdist plan`: the command that trains with `flags` as `processes` data-parallel
        processes (`per_node` per node) on devices of kind `device` (a100-80gb, tpu-v4, cpu, ...),
        or None when the planner should not recommend this strategy there."""
        return None

    # -- who am I ------------------------------------------------------------------------------
    @property
    def num_replicas(self):
        return self.tf_strategy.num_replicas_in_sync

    @property
    def is_chief(self):
        return True

    @property
    def worker_index(self):
        return 0

    @property
    def num_workers(self):
        return 1

    @property
    def is_server(self):
        """This process only serves others (a parameter server's worker and ps tasks)."""
        return False

    def serve(self):
        """Runs this process's task when it only serves others (a parameter server's worker and
        ps tasks) and then ends the process; returns at once on a process that trains."""

    def describe(self):
        devices = getattr(self.tf_strategy.extended, "worker_devices", ())
        return (f"{self.name}: {self.num_replicas} replica(s) on "
                f"{', '.join(devices) or 'default device'}")

    #: Saving a checkpoint is a collective operation (every worker must call it), as under the
    #: tf.distribute strategies. False: only the chief saves (Horovod).
    collective_checkpoints = True

    # -- what it adds --------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """The tf.distribute strategy's scope; a model compiled in it belongs to this plugin."""
        with self.tf_strategy.scope() as tf_strategy, self.entered():
            yield tf_strategy

    def distribute(self, dataset_fn, whole=False):
        """Per-replica datasets from `dataset_fn(input_context)`. Among islands (`dp.islands`)
        each island's part of the data, unless `whole` (validation: every island sees it all)."""
        if self.dp_outer is not None and not whole:
            place = self.dp_outer.place
            return self.tf_strategy.distribute_datasets_from_function(
                lambda context: dataset_fn(place.input_context(context)))
        return self.tf_strategy.distribute_datasets_from_function(dataset_fn)

    def reduce_gradients(self, grads_and_vars):
        """`grads_and_vars` with each gradient summed over the replicas: the strategy's
        collective, which tfdist's training step (`tfdist.step`) and a user's compiled optimizer
        (`wrap_optimizer`) both call. This one is what Keras's optimizer does under a
        tf.distribute strategy: one all-reduce of every gradient in the replica context (none
        with one replica). Plugins that reduce otherwise (buckets, Horovod) override it."""
        context = tf.distribute.get_replica_context()
        if context is None or self.tf_strategy.num_replicas_in_sync == 1:
            return list(grads_and_vars)
        from tfdist.parallel import buckets
        return buckets.reduce(grads_and_vars,
                              lambda grads: context.all_reduce(tf.distribute.ReduceOp.SUM, grads))

    def prepare_optimizer(self, optimizer):
        """What the strategy changes in an optimizer before training (Horovod: its linear
        learning-rate scaling). Returns it."""
        return optimizer

    def prepared(self, optimizer):
        """`prepare_optimizer(optimizer)`, once per optimizer: a model compiled inside the scope
        (`after_compile` wraps its optimizer) and then given to tfdist's step asks twice."""
        if not getattr(optimizer, "tfdist_prepared", False):
            self.prepare_optimizer(optimizer)
            optimizer.tfdist_prepared = True
            if self.dp_compression is not None:
                from tfdist.parallel.dp import compression
                compression.attach(optimizer, self.dp_compression)
            if self.dp_outer is not None:
                from tfdist.parallel.dp import islands
                islands.attach(optimizer, self.dp_outer)
        return optimizer

    def wrap_optimizer(self, optimizer):
        """A user's compiled optimizer adapted to the strategy: `prepare_optimizer`, then its
        gradients reduced by `reduce_gradients` inside Keras's `apply`, with tfdist's Keras 3
        corrections (`tfdist.compat.set_gradient_reduction`). tfdist's GPT needs none of this:
        its training step (`tfdist.step`) reduces and corrects the gradients itself."""
        from tfdist import compat
        from tfdist.parallel import gradients
        return compat.set_gradient_reduction(self.prepared(optimizer), self.reduce_gradients,
                                             gradients.reduce_and_correct)

    def local_variables(self):
        """The scope in which a variable is this process's own, one that no other process holds
        alike and none initialises from another's (the step's gradient sums): a tf.distribute
        strategy across processes makes its variables otherwise (`multi_worker_mirrored`)."""
        return contextlib.nullcontext()

    #: Every replica takes each update together, so the host may decide after a batch to skip
    #: it (`train.skip_nonfinite`). False: the workers apply their updates on their own (the
    #: parameter server; a loss spike's rollback (`train.spike`) works there too: its loop
    #: stops, drains the steps in flight, and the backup is restored).
    updates_together = True

    #: `() -> tfdist.parallel.zero.Collectives` of its data-parallel replicas; None: no ZeRO here.
    zero_collectives = None

    #: `() -> tfdist.parallel.dp.collectives.Collectives` of its workers, over which
    #: `config.dp`'s routes run (`tfdist.parallel.dp`); None: its gradients take its own path only.
    dp_collectives = None
    #: Its `tfdist.parallel.dp.Settings` (`config.dp`; set by `tfdist.strategies.get`).
    dp = None
    #: Its `tfdist.parallel.dp.compression.Compression` (`dp.compression`), or None: the state a
    #: backup keeps per worker, found through the optimizer (`prepared`).
    dp_compression = None
    #: Its `tfdist.parallel.dp.islands.Outer` (`dp.islands` > 1), or None: its island's outer
    #: state, which a backup keeps, found through the optimizer (`prepared`).
    dp_outer = None
    #: The values of `dp.compression` that the strategy does itself, in its own all-reduce
    #: (Horovod's fp16).
    own_compression = ()

    def lost_peer(self, error):
        """Why this process lost its cluster, if the TF error `error`, raised while training,
        says so: `fit` then raises `PeerLost` with it (one line, exit EXIT_PEER_LOST, and the
        supervisor restarts the group). None for any other error, which propagates as it is.
        Strategies whose processes wait on each other say how their collectives report that."""
        return None

    def barrier(self):
        """Returns once every process of the job has called it (one process: at once)."""

    def any_process(self, flag):
        """Whether `flag` is true in any process of the job (every process must call it, at the
        same point: it is a collective). One process: `flag`."""
        return bool(flag)

    def callbacks(self):
        """What the strategy adds to `fit`, before the others' callbacks."""
        return self.dp_callbacks()

    def dp_callbacks(self):
        """config.dp's: the islands' sync every `dp.sync_every` updates
        (`tfdist.parallel.dp.islands`), before the backup of the step is written."""
        if self.dp_outer is None:
            return []
        from tfdist.callbacks.islands import Sync
        return [Sync(self.dp_outer, chief=self.is_chief)]

    # -- training ------------------------------------------------------------------------------
    def fit(self, model, data, *, epochs=1, steps_per_epoch=None, initial_step=0, callbacks=None,
            validation_data=None, validation_steps=None, verbose="auto", strategy_callbacks=None,
            progress_every=1):
        """Trains `model` from global step `initial_step` to `epochs * steps_per_epoch`.

        `data` is either what Keras `fit` accepts (a `tf.data.Dataset`; then `initial_step` must
        fall on an epoch boundary, since tfdist cannot position a foreign dataset), or
        step-addressed data (`tfdist.data.Windows`, or a callable
        `data(start_step) -> dataset_fn(input_context)`): then training resumes at any step
        without replaying a batch. `validation_data` is a dataset, a `dataset_fn(input_context)`
        or a `Windows` (its first `validation_steps` steps, the same every time).

        A resume in the middle of an epoch runs as two Keras `fit` calls: the rest of the
        interrupted epoch, then the remaining whole epochs. `strategy_callbacks` replaces
        `self.callbacks()` (a test driver's hook). Unless `verbose=0`, the chief shows the
        progress (`tfdist.callbacks.Progress`: a line per `progress_every` steps when not on a
        terminal).
        """
        own = self.callbacks() if strategy_callbacks is None else list(strategy_callbacks)
        # the strategy's first (Horovod's broadcast must precede the first step; its log
        # averaging, the loggers)
        callbacks = own + list(callbacks or [])
        from tfdist import callbacks as callbacks_lib
        from tfdist import compat
        if getattr(model, "steps_per_execution", 1) > 1:  # Keras reports once per execution
            callbacks.insert(0, callbacks_lib.StepsPerCall())
        # one per cluster; last: it shows what the others add to the logs
        if verbose not in (0, False) and self.is_chief:
            callbacks.append(callbacks_lib.Progress(every=progress_every))
        if hasattr(data, "dataset_fn"):  # step-addressed data such as tfdist.data.Windows
            windows, total = data, epochs * (steps_per_epoch or 0)
            data = lambda start: windows.dataset_fn(start, total - start)  # noqa: E731
        if hasattr(validation_data, "dataset_fn"):
            validation_data = validation_data.dataset_fn(0, validation_steps, repeat=True)
        if callable(validation_data) and not isinstance(validation_data, tf.data.Dataset):
            validation_data = self.distribute(validation_data, whole=True)
        first_epoch, done_in_epoch = divmod(initial_step, steps_per_epoch or 1)
        positionable = callable(data) and not isinstance(data, tf.data.Dataset)
        if not positionable and done_in_epoch:
            raise UsageError(f"cannot resume at step {initial_step} (mid-epoch) with a plain "
                             f"dataset; pass a data(start_step) callable or resume at an epoch "
                             f"boundary")

        def train_data(start):
            return self.distribute(data(start)) if positionable else data

        upstream_fit = compat.keras_method("fit")  # Keras's own: the strategy's part is done here

        def keras_fit(*args, **kwargs):
            try:
                return upstream_fit(*args, **kwargs)
            except tf.errors.OpError as e:
                lost = self.lost_peer(e)
                if lost:
                    raise PeerLost(lost) from None
                raise

        history = None
        if done_in_epoch and first_epoch < epochs:  # finish the interrupted epoch
            history = keras_fit(model, train_data(initial_step), epochs=first_epoch + 1,
                                initial_epoch=first_epoch,
                                steps_per_epoch=steps_per_epoch - done_in_epoch,
                                callbacks=callbacks, validation_data=validation_data,
                                validation_steps=validation_steps, verbose=0, shuffle=False)
            first_epoch += 1
        if first_epoch < epochs and not model.stop_training:
            history = keras_fit(model, train_data(first_epoch * (steps_per_epoch or 0)),
                                epochs=epochs, initial_epoch=first_epoch,
                                steps_per_epoch=steps_per_epoch,
                                callbacks=callbacks, validation_data=validation_data,
                                validation_steps=validation_steps, verbose=0, shuffle=False)
        return history
