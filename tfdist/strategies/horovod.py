"""`horovod`: synchronous data parallelism by Horovod ring-allreduce, one process per rank.

Start the ranks with `horovodrun` (or `mpirun`, or `tfdist launch --strategy=horovod`, which adds
supervision and restart):

    horovodrun -np 2 -H localhost:2 --gloo tfdist train --config=configs/gpt_nano.py \\
        --config.strategy.name=horovod

Horovod's own Keras layer does not work on Keras 3: `horovod.tensorflow.keras` supports only
the legacy tf.keras optimizers (horovod/horovod#3725), and wrapping a Keras 3 optimizer constructs
and trains but never allreduces, so ranks diverge silently; `hvd.broadcast_variables` fails on
Keras 3 variables (`'Variable' object has no attribute 'ref'`) and its callbacks call
`keras.backend.get_value`, gone in Keras 3. This plugin is the Keras 3 integration, built on the
`horovod.tensorflow` primitives:

* `wrap_optimizer`: the optimizer's gradient all-reduce becomes one grouped Horovod allreduce
  (average over ranks; one group, so Horovod fuses it into few ring operations), optionally in
  fp16. Keras 3's own `gradient_accumulation_steps` accumulates locally and allreduces only on
  the steps that apply (Horovod's `backward_passes_per_step`). tfdist's Keras 3 corrections
  (`tfdist.compat.set_gradient_reduction`: sparse duplicates, clipping after the reduction)
  still apply after it.
* `callbacks()`: broadcast of the model and optimizer state from rank 0 when training begins
  (`[v.value for v in ...]`, which Horovod accepts), and the logged metrics averaged over ranks.
* `distribute`: each rank reads its own rows of every global batch (`InputContext` with
  `hvd.size()` pipelines), so `train.batch_size` stays the global batch as for every strategy.
* a user's own program (`model.compile` in `strategy.scope()`, or anywhere in the process: a
  process is one rank) needs none of the above: the compiled optimizer all-reduces, `fit` adds the
  callbacks, and a plain batched `tf.data.Dataset` given to `fit`, `evaluate` or `predict` is
  split as tf.distribute splits it (each global batch cut into `hvd.size()` pieces, rank r
  taking piece r). `evaluate` returns the metrics averaged over ranks and `predict` every row, in
  order, on every rank. A dataset whose batch size is unknown (batched without
  `drop_remainder=True`) or not a multiple of the ranks cannot be split: one line, exit 2.
* rank 0 is the chief: it alone writes backups, logs and the final model.
* `lr_scaling="linear"` multiplies the learning rate by the number of ranks (Goyal et al.), reached
  over tfdist's warmup; the default keeps the single-process learning rate, since tfdist's batch
  size is already global.

Usage (not run as a doctest: inside a program started by `horovodrun -np 2 ...`):

    import keras, tensorflow as tf, tfdist.strategies
    strategy = tfdist.strategies.get("horovod")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    ds = tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.ones((8, 1)))).repeat()
    model.fit(ds, epochs=1, steps_per_epoch=5)   # 4 rows per rank; identical weights after
"""
import os
import shutil
import sys
import weakref

import numpy as np

from tfdist.errors import UsageError
from tfdist.parallel import buckets
from tfdist.runtime.lazy import keras, tf
from tfdist.strategies.base import Launch, Strategy

_LR_SCALING = ("none", "linear")


def _missing(e):
    """The one line for Horovod not installed here (`e`: the ImportError)."""
    return UsageError(f"strategy horovod needs Horovod ({e}): `make horovod` installs the "
                      f"horovod extra and builds Horovod 0.28.1 for this TensorFlow")


def _import_horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise _missing(e) from None
    return hvd


def horovodrun_argv(n, argv, hosts=None):
    """`horovodrun` for `n` ranks over Gloo: on this host, on the loopback interface only; or on
    `hosts`, round robin (horovodrun starts the others' ranks through ssh and finds the
    interface the hosts share). It is Horovod's own launcher, run through
    `tfdist.launch.horovodrun` (which answers its build check without importing TensorFlow);
    `tfdist launch --strategy=horovod` starts the ranks itself instead (`Rendezvous`)."""
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "horovodrun")) and \
            not shutil.which("horovodrun"):
        raise UsageError("--strategy=horovod needs horovodrun: install Horovod with `make horovod`")
    if hosts:
        slots = {}
        for k in range(n):
            slots[hosts[k % len(hosts)]] = slots.get(hosts[k % len(hosts)], 0) + 1
        where = ["-H", ",".join(f"{h}:{c}" for h, c in slots.items())]
    else:
        where = ["-H", f"localhost:{n}", "--network-interfaces", "lo"]
    return [sys.executable, "-m", "tfdist.launch.horovodrun", "-np", str(n), *where, "--gloo",
            *argv]


def slots(addresses):
    """Horovod's SlotInfo of each rank (in order), for the host address of each: what
    horovodrun assigns (rank; local rank and size on its host; cross rank and size among the
    ranks of that local rank).

    >>> [s.to_response_string() for s in slots(["a", "a", "b"])]
    ['0,3,0,2,0,2', '1,3,1,2,0,1', '2,3,0,1,1,2']
    """
    from horovod.runner.common.util.hosts import SlotInfo
    hosts = list(dict.fromkeys(addresses))
    local = [addresses[:i].count(a) for i, a in enumerate(addresses)]
    out = []
    for rank, (address, local_rank) in enumerate(zip(addresses, local)):
        # the cross group: the ranks with this local rank, one per host that has it
        with_local = [h for h in hosts if addresses.count(h) > local_rank]
        out.append(SlotInfo(hostname=address, rank=rank, local_rank=local_rank,
                            cross_rank=with_local.index(address), size=len(addresses),
                            local_size=addresses.count(address), cross_size=len(with_local)))
    return out


def rank_env(slot, rendezvous, port, interface):
    """The variables `horovodrun --gloo` gives a rank: its slot (`slots`), the rendezvous
    server's address and port, Gloo as controller and CPU operations, and the network interface
    of its host's address (Gloo binds it)."""
    return {"HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
            "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
            "HOROVOD_LOCAL_SIZE": str(slot.local_size),
            "HOROVOD_CROSS_RANK": str(slot.cross_rank),
            "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": interface}


class Rendezvous:
    """Horovod's ranks as `tfdist launch` starts them, without horovodrun: Horovod's Gloo
    rendezvous server (`horovod.runner.http.http_server.RendezvousServer`, what horovodrun
    starts), told each group's plan, and each rank's variables (`rank_env`). Each rank is then a
    task of tfdist's supervisor, started warm by its host's agent, its exit status its own.

    >>> r = Rendezvous()
    >>> env = r.start(["127.0.0.1", "127.0.0.1"], ["lo", "lo"], here="127.0.0.1")
    >>> [e["HOROVOD_RANK"] for e in env], env[1]["HOROVOD_LOCAL_SIZE"]
    (['0', '1'], '2')
    >>> r.stop()
    """

    def __init__(self):
        self.server = None

    def start(self, addresses, interfaces, here):
        """The variables of each rank of a group on `addresses` (a host's address per rank;
        `interfaces`: the interface holding each), met at `here` (this machine's address as the
        ranks reach it)."""
        try:
            from horovod.runner.http.http_server import RendezvousServer
        except ImportError as e:
            raise _missing(e) from None
        plan = slots(addresses)
        if self.server is None:
            self.server = RendezvousServer()
            self.port = self.server.start()
        self.server.init(plan)  # (a new group: a new plan, the old one's state forgotten)
        return [rank_env(s, here, self.port, i) for s, i in zip(plan, interfaces)]

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None


class Horovod(Strategy):
    name = "horovod"
    supports_jit_compile = False  # Horovod's ops have no XLA kernels on CPU
    runs_keras_accumulation = True  # its allreduce is an op, not a merge_call
    own_compression = ("fp16",)  # dp.compression=fp16: Horovod's Compression.fp16, in its ring
    options = {
        "lr_scaling": ("none", lambda v: v in _LR_SCALING,
                       "one of " + ", ".join(_LR_SCALING) + " (linear: lr x ranks)"),
        **buckets.OPTIONS,
    }
    # Each rank a task of tfdist launch, met through Horovod's Gloo rendezvous (any failure
    # restarts the group); on Ray, each rank a Ray Train worker, met the same way.
    launch = Launch(rendezvous=Rendezvous, elastic=None, ray=None, ray_backend="horovod_gloo",
                    recovery=None)
    process_wide = True  # a rank's every model trains under it

    def __init__(self, lr_scaling="none", bucket_mb=buckets.BUCKET_MB, overlap="auto", dp=None,
                 **unused_options):
        # Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (default 1). With Gloo,
        # at 1 ms a rank spent 0.74-0.88 of a core doing nothing (measured here, 2 idle ranks on
        # 127.0.0.1); at 5 ms 0.05. A collective then waits up to 5 ms for the next cycle, which
        # is small beside a training step. horovodrun --cycle-time-ms (or the variable) wins.
        os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")
        self.hvd = _import_horovod()
        # config.dp's hierarchy meets in process sets made after init, which Horovod allows once
        # told before it. `auto`: whether the ranks span several hosts of several ranks each, from
        # the variables horovodrun and tfdist launch give every rank (mpirun does not: flat).
        several = int(os.environ.get("HOROVOD_LOCAL_SIZE", 1)) > 1 and \
            int(os.environ.get("HOROVOD_CROSS_SIZE", 1)) > 1
        # dp.compression: fp16 is Horovod's own (its Compression.fp16, in its ring); bf16 and
        # powersgd are tfdist's, over a process set of every rank.
        compression = dp.compression if dp is not None else "none"
        hierarchy = dp is not None and (dp.hierarchy == "host" or
                                        dp.hierarchy == "auto" and several or
                                        compression in ("bf16", "powersgd"))
        if hierarchy:
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        self.hvd.init()
        self.compression = compression
        self.lr_scaling = lr_scaling
        self.bucket_bytes = buckets.to_bytes(bucket_mb)
        self._bucketed = overlap != "off"  # (ZeRO reduce-scatters instead: tfdist.parallel.zero)
        self._per_rank = weakref.WeakSet()
        super().__init__(tf.distribute.get_strategy())  # one device per rank; Horovod reduces
        self._hosts = None  # (gathered once: `hosts`)
        self._dp = None
        if hierarchy:
            # The gradients' route (config.dp): Horovod's flat ring, tfdist's hierarchy, or its
            # compressed sums.
            if dp.route(self.hosts()) != "flat":
                self._dp = self.dp_collectives()
        self.dp_compression = (dp.compressor(self.local_variables, self.worker_index,
                                               self.num_workers) if dp is not None else None)
        # config.dp.islands: this worker's island's outer state (tfdist.parallel.dp.islands)
        self.dp_outer = dp.outer(self.local_variables) if dp is not None else None

    # -- who am I ------------------------------------------------------------------------------
    @property
    def num_replicas(self):
        return self.hvd.size()

    @property
    def is_chief(self):
        return self.hvd.rank() == 0

    @property
    def worker_index(self):
        return self.hvd.rank()

    @property
    def num_workers(self):
        return self.hvd.size()

    #: Only rank 0 writes a backup; the others need not take part (unlike a tf.distribute
    #: strategy).
    collective_checkpoints = False

    def describe(self):
        if self.hvd.size() == 1:
            return (f"{self.name}: 1 rank (start several with horovodrun, mpirun or "
                    f"`tfdist launch --strategy=horovod`)")
        return (f"{self.name}: rank {self.hvd.rank()} of {self.hvd.size()}, ring-allreduce "
                f"({'gloo' if self.hvd.gloo_enabled() else 'mpi'}), compression {self.compression}")

    # -- what it adds --------------------------------------------------------------------------
    def distribute(self, dataset_fn, whole=False):
        """This rank's dataset: `dataset_fn` sees `hvd.size()` pipelines, one replica each
        (among islands, this island's after the others': unless `whole`)."""
        n = self.hvd.size()
        context = tf.distribute.InputContext(num_input_pipelines=n,
                                             input_pipeline_id=self.hvd.rank(),
                                             num_replicas_in_sync=n)
        if self.dp_outer is not None and not whole:
            context = self.dp_outer.place.input_context(context)
        dataset = dataset_fn(context)
        self._per_rank.add(dataset)  # already this rank's share: `split` leaves it
        return dataset

    def prepare_optimizer(self, optimizer):
        """`lr_scaling="linear"`: the learning rate times the ranks (a schedule is wrapped, so its
        warmup ramps to the scaled rate)."""
        if self.lr_scaling == "linear" and self.hvd.size() > 1:
            scale_learning_rate(optimizer, self.hvd.size())
        return optimizer

    def barrier(self):
        self.hvd.allreduce(tf.constant(0.0), name="tfdist_barrier")

    def any_process(self, flag):
        total = self.hvd.allreduce(tf.constant(1.0 if flag else 0.0), op=self.hvd.Sum,
                                   name="tfdist_any_process")
        return bool(total > 0)

    def lost_peer(self, error):
        """A Gloo operation that fails (a rank gone, or a peer unanswered for
        HOROVOD_GLOO_TIMEOUT_SECONDS, default 30 s: a partitioned host) shuts Horovod down on that
        rank, and every later collective fails with "Horovod has been shut down"."""
        if "Horovod has been shut down" not in str(error):
            return None
        return (f"rank {self.hvd.rank()} of {self.hvd.size()} lost its peers: Horovod shut down "
                f"after a collective failed (a rank gone, or none answered within "
                f"HOROVOD_GLOO_TIMEOUT_SECONDS). Restart the ranks (tfdist launch does): they "
                f"resume from rank 0's last backup")

    shards_user_models = True  # tfdist.strategies.get("horovod", zero=3): ZeRO-3 of a user's model

    def zero_collectives(self):
        """ZeRO's collectives: Horovod's reducescatter (averaging, as its allreduce here),
        allgather (of buffers of any length: ragged), and a summing allreduce, under fixed names
        (in a graph, ranks meet by name)."""
        from tfdist.parallel.zero import Collectives
        hvd = self.hvd
        return Collectives(
            hvd.rank(), hvd.size(),
            lambda x, name=None: hvd.reducescatter(x, op=hvd.Average,
                                                   name=name or "tfdist_zero_reducescatter",
                                                   ignore_name_scope=True),
            lambda x, name=None: hvd.allgather(x, name=name or "tfdist_zero_allgather",
                                               ignore_name_scope=True),
            lambda x: hvd.allreduce(x, op=hvd.Sum, name="tfdist_zero_norm", ignore_name_scope=True),
            lambda variable, value: variable.assign(value), ragged=True)

    def hosts(self):
        """Where the ranks are (`tfdist.parallel.dp.hosts.Hosts`): each rank's host name (the
        address tfdist launch and horovodrun give it, else this machine's name), gathered once
        (a collective: every rank calls it)."""
        if self._hosts is None:
            import socket
            import zlib

            from tfdist.parallel.dp.hosts import Hosts
            name = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
            ids = self.hvd.allgather(tf.constant([zlib.crc32(name.encode())], tf.int64),
                                     name="tfdist_hosts").numpy().tolist()
            self._hosts = Hosts(tuple(ids), self.hvd.rank())
        return self._hosts

    def dp_collectives(self):
        """config.dp's sums over the ranks (`tfdist.parallel.dp.collectives`): Horovod's
        reducescatter, allreduce and allgather over process sets, one per host and one per local
        rank across the hosts, added on every rank in the same order (Horovod's dynamic process
        sets: needs HOROVOD_DYNAMIC_PROCESS_SETS=1 before init, which __init__ sets)."""
        from tfdist.parallel.dp.collectives import Collectives
        hvd, hosts = self.hvd, self.hosts()
        sets = {"all": hvd.global_process_set}
        made = {tuple(range(hvd.size())): hvd.global_process_set}  # (Horovod refuses a twin)

        def process_set(ranks):
            ranks = tuple(sorted(ranks))
            if ranks not in made:
                made[ranks] = hvd.add_process_set(list(ranks))
            return made[ranks]

        for host in hosts.names:  # (every rank adds every set, in the same order)
            local = process_set(hosts.workers_on(host))
            if host == hosts.of_worker[hosts.rank]:
                sets["local"] = local
        for k in range(hosts.per_host):
            cross = process_set(hosts.workers_on(h)[k] for h in hosts.names)
            if k == hosts.local_rank:
                sets["cross"] = cross

        def named(name):  # (an op's name: no scopes)
            return dict(name=name.replace("/", "_"), ignore_name_scope=True)

        return Collectives(
            hosts,
            lambda x, group, name: tf.reshape(hvd.reducescatter(
                x, op=hvd.Sum, process_set=sets[group], **named(name)), [-1]),
            lambda x, group, name: hvd.allreduce(x, op=hvd.Sum, process_set=sets[group],
                                                 **named(name)),
            lambda x, group, name: hvd.allgather(x, process_set=sets[group], **named(name)),
            lambda x, group, name: tf.reshape(hvd.alltoall(
                x, process_set=sets[group], **named(name)), x.shape),
            1.0 / hvd.size())

    def reduce_gradients(self, grads_and_vars):
        """The gradient all-reduce Keras calls before every update: a grouped Horovod average per
        bucket (tfdist/parallel/buckets.py), each started as soon as its gradients exist; or one
        group after the backward pass (`overlap=off`). config.dp's hierarchy takes its own route
        (`tfdist.parallel.dp`)."""
        if self._dp is not None:
            from tfdist.parallel import dp
            return dp.reduce(grads_and_vars, self._dp,
                             self.bucket_bytes if self._bucketed else None,
                             self.is_chief and "horovod", self.dp_compression)
        hvd = self.hvd
        compression = hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none
        return allreduce_gradients(hvd, grads_and_vars, compression=compression,
                                   bucket_bytes=self.bucket_bytes if self._bucketed else None,
                                   log=self.is_chief)

    def callbacks(self):
        """Rank 0's model and optimizer state to every rank before the first step; the model's
        non-trainable state (BatchNormalization's statistics) averaged over the ranks before
        validation and at the end; the logged metrics averaged over the ranks; config.dp's
        (the islands' sync: `dp_callbacks`)."""
        from tfdist.callbacks import Calls
        hvd = self.hvd
        average_state = lambda model, *args, **kw: _average_state(hvd, model)  # noqa: E731
        return [Calls("broadcast_from_root",
                      on_train_begin=lambda model, logs=None: broadcast_from_root(hvd, model)),
                Calls("average_state", on_test_begin=average_state, on_epoch_end=average_state,
                      on_train_end=average_state),
                Calls("average_logs",
                      on_train_batch_end=lambda model, batch, logs=None: average_logs(
                          hvd, logs, "batch"),
                      on_epoch_end=lambda model, epoch, logs=None: average_logs(
                          hvd, logs, "epoch"))] + self.dp_callbacks()

    # -- a user's Keras program --------------------------------------------------------------
    def keras_call(self, method, model, upstream, arguments):
        if method == "save":
            return self.save(model, upstream, arguments)
        from tfdist import compat
        arguments["x"], rows = self.split(arguments["x"], method)
        callbacks = self.for_this_process(arguments.get("callbacks"))
        verbose = arguments["verbose"]
        arguments["verbose"] = verbose if self.is_chief else 0
        if method == "fit":
            arguments["validation_data"], _ = self.split(arguments["validation_data"], "validate")
            show = [keras.callbacks.ProgbarLogger()] if self.is_chief and verbose != 0 else []
            compat.build_for(model, arguments["x"])  # before the broadcast of its weights
            first, last = self.stepped(model, method, arguments)  # (ZeRO-3)
            # self.callbacks() before the others: they see the metrics averaged
            arguments["callbacks"] = first + self.callbacks() + show + callbacks + last
            return upstream(model, **arguments)
        self.stepped(model, method, arguments)
        arguments["callbacks"] = callbacks
        if method == "evaluate":
            return_dict = arguments["return_dict"]
            arguments["return_dict"] = True
            logs = average_logs(self.hvd, upstream(model, **arguments), "evaluate")
            return logs if return_dict else compat.flatten_metrics(model, logs)
        return self.gather_rows(upstream(model, **arguments), rows)  # predict

    def split(self, data, what):
        """This rank's share of a plain batched dataset: each batch of B rows cut into
        `hvd.size()` pieces of B/size, rank r taking piece r of every batch (the rows
        tf.distribute's auto-sharding gives replica r). Returns (dataset, B/size); other data
        unchanged, (data, None)."""
        n = self.hvd.size()
        if n > 1 and data is not None and not isinstance(data, tf.data.Dataset) and self.is_chief:
            print(f"tfdist: horovod: the {type(data).__name__} given to {what} is not split over "
                  f"the {n} ranks (each rank reads all of it: correct, but no faster); pass a "
                  f"batched tf.data.Dataset to split it", file=sys.stderr, flush=True)
        if n == 1 or not isinstance(data, tf.data.Dataset) or data in self._per_rank:
            return data, None
        shapes = [spec.shape for spec in tf.nest.flatten(data.element_spec)]
        batch = shapes[0][0] if shapes and shapes[0].rank else None
        if batch is None or batch % n:
            got = "unknown (batched without drop_remainder=True)" if batch is None else batch
            raise UsageError(f"horovod splits every batch of the dataset given to {what} over "
                             f"{n} ranks, but its batch size is {got}; batch it with a multiple "
                             f"of {n} and drop_remainder=True")
        rows, first = batch // n, batch // n * self.hvd.rank()
        # Slicing keeps the dataset's cardinality; `rebatch(rows).shard(n, rank)` selects the same
        # rows but loses it, and Keras 3 then counts a phantom last batch in evaluate's mean.
        return data.map(lambda *batch: tf.nest.map_structure(
            lambda t: t[first:first + rows], batch if len(batch) > 1 else batch[0])), rows

    def gather_rows(self, outputs, rows):
        """`predict`'s outputs of every rank, in the order of the unsplit dataset: rank r holds
        piece r of every batch, `rows` rows each."""
        if rows is None:
            return outputs
        n = self.hvd.size()

        def gather(local):
            every = self.hvd.allgather(tf.constant(local)).numpy()  # rank 0's rows, rank 1's, ...
            pieces = every.reshape((n, -1, rows) + every.shape[1:])  # rank, batch, row
            return pieces.swapaxes(0, 1).reshape((-1,) + every.shape[1:])
        return tf.nest.map_structure(gather, outputs)


def scale_learning_rate(optimizer, factor):
    """lr x `factor`: a schedule is wrapped (its warmup then ramps to the scaled rate)."""
    from tfdist import compat
    from tfdist.optimizers import Scaled
    lr = compat.learning_rate_schedule(optimizer)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        compat.set_learning_rate_schedule(optimizer, Scaled(lr, factor))
    else:
        optimizer.learning_rate = optimizer.learning_rate * factor


def allreduce_gradients(hvd, grads_and_vars, compression=None, op=None, prescale_factor=1.0,
                        postscale_factor=1.0, bucket_bytes=None, log=False):
    """`grads_and_vars` with the gradients reduced over the ranks: in one grouped allreduce (one
    group: Horovod fuses it into few ring operations), or with `bucket_bytes` in one group per
    bucket (`tfdist.parallel.buckets`: the last variables first), each of which Horovod starts as
    soon as its gradients exist. `op` defaults to the average. `log`: say how, once."""

    def reduce_group(grads):
        if not tf.executing_eagerly():
            # In a graph Horovod names the collective after its first and last tensors, and
            # ranks meet by name. Those names follow Keras's automatic layer and optimizer names,
            # which differ between ranks once one rank has built a model more (the chief loading
            # a saved one): the ranks then wait for each other forever. Names of our own, the
            # same on every rank (an absolute name scope):
            with tf.name_scope("tfdist_allreduce/"):
                grads = [tf.IndexedSlices(tf.identity(g.values, name="gradient"),
                                          tf.identity(g.indices, name="indices"), g.dense_shape)
                         if isinstance(g, tf.IndexedSlices) else tf.identity(g, name="gradient")
                         for g in grads]
        return hvd.grouped_allreduce(grads, op=hvd.Average if op is None else op,
                                     compression=compression or hvd.Compression.none,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, ignore_name_scope=True)

    return buckets.reduce(grads_and_vars, reduce_group, bucket_bytes, log and "horovod")


def broadcast_variables(hvd, variables, root_rank=0):
    """Horovod's broadcast for Keras 3 variables too: they are not tf.Variables, so Horovod
    broadcasts into the TF variables they wrap (`'Variable' object has no attribute 'ref'`
    otherwise)."""
    hvd.broadcast_variables([v.value if isinstance(v, keras.Variable) else v for v in variables],
                            root_rank=root_rank)


def broadcast_from_root(hvd, model, root_rank=0):
    """The root rank's model and optimizer state to every rank (before the first step: Keras
    builds the optimizer's variables before `on_train_begin`). Under ZeRO each rank's optimizer
    slots are its own, and stay; under ZeRO-3 so are its weights (each has one copy)."""
    from tfdist.parallel import zero
    variables = list(model.variables) + list(model.optimizer.variables)
    sharded = zero.of(model)
    broadcast_variables(hvd, sharded.common(variables) if sharded else variables, root_rank)


def _average_state(hvd, model):
    """The model's non-trainable float variables (BatchNormalization's moving statistics)
    averaged over ranks. Each rank updates them from its own rows (as each replica does under
    MirroredStrategy, which keeps them per replica); averaged, the ranks hold identical weights,
    and an average of moving averages that started equal is the moving average of the averaged
    batch statistics."""
    state = [v for v in model.non_trainable_variables if "float" in str(v.dtype)]
    if state:
        means = hvd.grouped_allreduce([v.value for v in state], op=hvd.Average)
        for v, mean in zip(state, means):
            v.assign(mean)


def average_logs(hvd, logs, name):
    """`logs` (a dict of metrics), its scalars replaced by their average over ranks, in place."""
    if not logs:
        return logs
    # the same keys, in the same order, on every rank
    keys = sorted(k for k, v in logs.items()
                  if not k.startswith("tfdist/") and np.ndim(v) == 0)
    if keys:
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        mean = hvd.allreduce(values, op=hvd.Average, name=f"tfdist_logs_{name}").numpy()
        for k, v in zip(keys, mean):
            logs[k] = float(v)
    return logs
