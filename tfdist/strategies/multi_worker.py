"""`multi_worker_mirrored`: synchronous data parallelism across processes (collective all-reduce).

The cluster comes from TF_CONFIG (set by `tfdist launch`, a Kubernetes TFJob, or by hand) or from
Slurm. Building the strategy blocks until every worker is up. Keras 3 `fit` needs two upstream
corrections here (keras-team/keras#20585), applied from `tfdist.compat`.
"""
import os
import re
import zlib

from tfdist.errors import UsageError
from tfdist.parallel import buckets
from tfdist.runtime import cluster as cluster_lib
from tfdist.runtime.lazy import tf
from tfdist.strategies.base import Launch, Strategy

_IMPLEMENTATIONS = ("auto", "ring")  # tf.distribute.experimental.CommunicationImplementation


#: The collective group of ZeRO's ops (tf.distribute numbers its own groups from 1).
_ZERO_GROUP = 0x2E50
#: The first collective group, and instance key, of config.dp's routes (tfdist.parallel.dp).
_DP_GROUP = 0x7D00
_DP_INSTANCE = 1 << 30


def _configure_heartbeats(cluster):
    """TFDIST_HEARTBEAT_TIMEOUT (seconds): how long TF's coordination service (leader: worker 0)
    waits for a worker's heartbeat before it takes the worker as gone and aborts the group (TF's
    default: 10 s). On a slow link a heartbeat can wait longer than that behind the gradients
    (10 Mbit/s, the hierarchy's phase across hosts: 43 MB out of a host, 35 s), and the group
    restarts for nothing. MultiWorkerMirroredStrategy configures the service only when nothing
    has (TF 2.21, collective_all_reduce_strategy.py: `if context.context().coordination_service
    is None`), so this configures it first as the strategy would, with the timeout (a row of
    tfdist/compat/table.py: TF has no public option for it)."""
    value = os.environ.get("TFDIST_HEARTBEAT_TIMEOUT")
    if not value:
        return
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UsageError(f"TFDIST_HEARTBEAT_TIMEOUT={value!r}: give the seconds TF's coordination "
                         f"service waits for a worker's heartbeat, a number > 0 (TF's default: 10)")
    from tfdist import compat
    compat.configure_heartbeats(cluster.resolver().cluster_spec(), int(seconds * 1000))


class MultiWorkerMirrored(Strategy):
    name = "multi_worker_mirrored"
    supports_jit_compile = False
    options = {"cross_device_ops": ("auto", lambda v: v in _IMPLEMENTATIONS,
                                    "one of " + ", ".join(_IMPLEMENTATIONS)),
               **buckets.OPTIONS}
    # N workers with TF_CONFIG; any failure restarts the group (on Ray too: its workers' TF_CONFIG
    # from tfdist.launch.ray_roles).
    launch = Launch(elastic=None, ray=None, recovery=None)
    shards_user_models = True  # tfdist.strategies.get("multi_worker_mirrored", zero=3)

    @classmethod
    def plan_command(cls, device, processes, per_node, flags):
        if processes == 1 or device.startswith("tpu"):
            return None
        if processes <= per_node:
            return f"tfdist launch --workers {processes} -- " + " ".join(flags)
        return (f"sbatch --nodes={-(-processes // per_node)} --ntasks-per-node={per_node} "
                f"launchers/slurm/tfdist.sbatch " + " ".join(flags))

    def __init__(self, cross_device_ops="auto", cluster=None, bucket_mb=buckets.BUCKET_MB,
                 overlap="auto", dp=None, **unused_options):
        self.cluster = cluster or cluster_lib.from_environment(allowed_roles=("chief", "worker"))
        if self.cluster is None:
            raise UsageError("multi_worker_mirrored needs a cluster: set TF_CONFIG, run in a Slurm "
                             "job step, or start the workers with `tfdist launch`")
        from tfdist import compat
        compat.fix_fit_under_multi_worker()
        options = tf.distribute.experimental.CommunicationOptions(implementation=getattr(
            tf.distribute.experimental.CommunicationImplementation, cross_device_ops.upper()))
        # Building the strategy blocks until every worker has joined TF's coordination service,
        # which waits an hour for a missing one. A host that is down or cut off ends the wait
        # after JOIN_TIMEOUT s instead: one line, exit 69, and the supervisor tries again.
        # It waits in C++ with the GIL held, where no Python timer runs, and TF 2.21 gives no
        # option for that wait (cluster_register_timeout does not bound it: measured), so a
        # watchdog process ends this one (SIGKILL, after one line) if the wait runs out.
        timeout = float(os.environ.get("TFDIST_JOIN_TIMEOUT", self.JOIN_TIMEOUT))
        _configure_heartbeats(self.cluster)
        with cluster_lib.watchdog(timeout, (
                f"worker {self.cluster.worker_index} of {self.cluster.num_workers}: not every "
                f"worker joined within {timeout:g} s (one is not started, down, or cut off); "
                f"stopping this worker for the group to restart (TFDIST_JOIN_TIMEOUT sets the "
                f"wait)")):
            super().__init__(tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=self.cluster.resolver(), communication_options=options))
        self._barrier = None
        self.bucket_bytes = buckets.to_bytes(bucket_mb)
        self._bucketed = overlap != "off"  # (ZeRO reduce-scatters instead: tfdist.parallel.zero)
        # The gradients' route (config.dp): the strategy's own flat ring, or tfdist's hierarchy.
        route = dp.route(self.hosts()) if dp is not None else "flat"
        self._dp = self.dp_collectives() if route != "flat" else None
        self.dp_compression = (dp.compressor(self.local_variables, self.worker_index,
                                               self.num_workers) if dp is not None else None)
        # config.dp.islands: this worker's island's outer state (tfdist.parallel.dp.islands)
        self.dp_outer = dp.outer(self.local_variables) if dp is not None else None

    JOIN_TIMEOUT = 180.0  # seconds for every worker to join; TFDIST_JOIN_TIMEOUT overrides

    @property
    def is_chief(self):
        return self.cluster.is_chief

    @property
    def worker_index(self):
        return self.cluster.worker_index

    @property
    def num_workers(self):
        return self.cluster.num_workers

    def reduce_gradients(self, grads_and_vars):
        """The sum over the replicas that Keras's optimizer makes (`ReplicaContext.all_reduce`,
        the strategy's collective ops), made once per bucket (tfdist/parallel/buckets.py). Each
        call is one collective (TF packs a call's tensors into one); TF orders a worker's
        collectives as they were made, the last layers' first, and starts each as soon as its
        gradients exist. With `overlap=off`: one call, after the backward pass, as Keras makes it.
        """
        context = tf.distribute.get_replica_context()
        if context is None:  # cross-replica context: nothing to reduce (Keras's rule)
            return list(grads_and_vars)
        if self._dp is not None:  # config.dp's route (tfdist.parallel.dp)
            from tfdist.parallel import dp
            return dp.reduce(grads_and_vars, self._dp,
                             self.bucket_bytes if self._bucketed else None,
                             self.cluster.is_chief and "multi_worker_mirrored",
                             self.dp_compression)
        return buckets.reduce(
            grads_and_vars, lambda grads: context.all_reduce(tf.distribute.ReduceOp.SUM, grads),
            self.bucket_bytes if self._bucketed else None,
            self.cluster.is_chief and "multi_worker_mirrored")

    def barrier(self):
        """Every worker meets: a summing all-reduce of one scalar (the strategy's own keys)."""
        self.any_process(False)

    def any_process(self, flag):
        """A summing all-reduce of one scalar per replica over the workers."""
        if self._barrier is None:  # (a function: run eagerly, the strategy warns of overhead)
            s = self.tf_strategy
            self._barrier = tf.function(
                lambda x: s.reduce("SUM", s.run(tf.identity, (x,)), axis=None), autograph=False)
        return bool(self._barrier(tf.constant(1.0 if flag else 0.0)) > 0)

    def lost_peer(self, error):
        """TF's coordination service (started by this strategy, leader: worker 0) takes a worker
        that sends no heartbeat for 10 s (its default) as gone, and aborts every worker's
        collectives: "Collective ops is aborted by: ... The following tasks are unhealthy
        (stopped sending heartbeats)" on the others, and on the cut-off worker its own heartbeat
        RPC's DEADLINE_EXCEEDED. A partitioned host or a dead process ends here, within about
        10 s, instead of hanging in the all-reduce."""
        text = str(error)
        if not isinstance(error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                                  tf.errors.CancelledError, tf.errors.AbortedError)) or \
                "Collective ops is aborted" not in text:
            return None
        if "stopped sending heartbeats" in text:
            tasks = sorted(set(re.findall(r"/job:(\w+)/replica:0/task:(\d+)", text)))
            why = (", ".join(f"{job} {task}" for job, task in tasks) or "a worker") + \
                " stopped sending heartbeats to TF's coordination service"
        elif "CoordinationService/Heartbeat" in text:
            why = "its heartbeats to TF's coordination service (on worker 0) went unanswered"
        else:
            why = text.split("Collective ops is aborted by:", 1)[1].strip().splitlines()[0]
        return (f"worker {self.worker_index} of {self.num_workers} lost its cluster: {why}; the "
                f"collectives were aborted. Restart the group (tfdist launch and "
                f"launchers/slurm/tfdist.sbatch do): it resumes from the last backup")

    def local_variables(self):
        """Variables of this worker's own: not mirrored, so not initialised by a broadcast from
        worker 0 (ZeRO's slot shards and the step's gradient sums differ between workers)."""
        from tfdist import compat
        return compat.local_variables(self.tf_strategy)

    def zero_collectives(self):
        """ZeRO's collectives over the workers, one replica each: TF's collective ops (public
        `tf.raw_ops`) in a group of ZeRO's own, so its keys never meet the strategy's. TF 2.21's
        reduce-scatter exists for NCCL only ("did not find collective implementation" on CPU), so
        it is an all-to-all of the N segments, then a sum: each worker sends (N-1)/N of the
        buffer, as a ring reduce-scatter does. Sums, as Keras's all-reduce here (the loss is
        already scaled by the global batch)."""
        from tfdist.parallel.zero import Collectives
        if self.num_replicas != self.num_workers:
            raise UsageError(f"ZeRO under {self.name} needs one replica per worker (here "
                             f"{self.num_replicas} replicas on {self.num_workers} workers); start "
                             f"one worker per device, or set zero.stage=0")
        n, strategy = self.num_workers, self.tf_strategy

        def key(name, default):
            """The instance key: a named collective (ZeRO-3: one per unit and use) has its own."""
            return default if name is None else 1000 + zlib.crc32(name.encode()) % (1 << 30)

        def group(x):
            """The group of the device `x` is on: TF's groups are of devices, and ZeRO-3's
            gathers run on each pipeline stage's device ("joining a group that is already full"
            when two devices of a worker shared one key)."""
            device = tf.DeviceSpec.from_string(x.device or "")
            index = device.device_index or 0 if device.device_type else 0
            return dict(group_size=n, group_key=_ZERO_GROUP + index, ordering_token=[])

        def reduce_scatter(flat, name=None):
            chunks = tf.raw_ops.CollectiveAllToAllV2(input=tf.reshape(flat, [n, -1]),
                                                     instance_key=key(name, 1), **group(flat))
            return tf.reduce_sum(chunks, 0)

        def assign(variable, value):
            """Each local copy of a mirrored variable, this worker only."""
            for v in strategy.experimental_local_results(variable.value):
                v.assign(value)

        return Collectives(
            self.worker_index, n, reduce_scatter,
            lambda flat, name=None: tf.raw_ops.CollectiveGatherV2(
                input=flat, instance_key=key(name, 2), **group(flat)),
            lambda x: tf.raw_ops.CollectiveReduceV2(input=x, instance_key=3, merge_op="Add",
                                                    final_op="Id", **group(x)),
            assign, self.local_variables)

    def hosts(self):
        """Where the workers are (`tfdist.parallel.dp.hosts.Hosts`): the host part of each
        worker's address in the cluster, chief first (tf.distribute's worker order)."""
        from tfdist.parallel.dp.hosts import Hosts
        spec = self.cluster.cluster
        addresses = list(spec.get("chief", [])) + list(spec.get("worker", []))
        return Hosts(tuple(a.rpartition(":")[0] for a in addresses), self.worker_index)

    def dp_collectives(self):
        """config.dp's sums over the workers (`tfdist.parallel.dp.collectives`): TF's collective
        ops (public `tf.raw_ops`), one group per host and one per local rank across the hosts,
        of their own keys (none meets the strategy's or ZeRO's). A reduce-scatter is an
        all-to-all and a sum (TF 2.21 has none on CPU: `zero_collectives`)."""
        from tfdist.parallel.dp.collectives import Collectives
        if self.num_replicas != self.num_workers:
            raise UsageError(f"config.dp's routes under {self.name} need one replica per worker "
                             f"(here {self.num_replicas} replicas on {self.num_workers} "
                             f"workers); start one worker per device, or set dp.hierarchy=flat and "
                             f"dp.compression=none")
        hosts = self.hosts()
        groups = {"all": (self.num_workers, 0),
                  "local": (len(hosts.local), 1 + hosts.host_index),
                  "cross": (len(hosts.cross), 1 + len(hosts.names) + hosts.local_rank)}

        def keys(group, name):
            size, index = groups[group]
            return dict(group_size=size, group_key=_DP_GROUP + index, ordering_token=[],
                        instance_key=_DP_INSTANCE + zlib.crc32(name.encode()) % (1 << 29))

        return Collectives(
            hosts,
            lambda x, group, name: tf.reduce_sum(
                tf.raw_ops.CollectiveAllToAllV2(input=x, **keys(group, name)), 0),
            lambda x, group, name: tf.raw_ops.CollectiveReduceV2(
                input=x, merge_op="Add", final_op="Id", **keys(group, name)),
            lambda x, group, name: tf.raw_ops.CollectiveGatherV2(input=x, **keys(group, name)),
            lambda x, group, name: tf.reshape(
                tf.raw_ops.CollectiveAllToAllV2(input=x, **keys(group, name)), x.shape),
            1.0)

    def describe(self):
        return (f"{self.name}: worker {self.worker_index} of {self.num_workers}, "
                f"{self.num_replicas} replica(s) in sync")

