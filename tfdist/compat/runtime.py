"""TensorFlow's runtime: the parameter-server coordinator's queue, the profiler's XSpace, Slurm's
task counts. Each function names its row of the patch table (`tfdist/compat/table.py`)."""
import tensorflow as tf

from tfdist.compat.table import using


def configure_heartbeats(cluster_spec, milliseconds):
    """TF's coordination service for the workers of `cluster_spec`, configured as
    MultiWorkerMirroredStrategy would (it configures it only when nothing has), but with a
    heartbeat timeout of `milliseconds` ("coordination_heartbeat")."""
    using("coordination_heartbeat")
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context
    jobs = [coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker") if job in cluster_spec.jobs]
    context.context().configure_coordination_service(
        service_type="standalone", service_leader=multi_worker_util.coordination_leader(
            cluster_spec), coordinated_jobs=jobs, heartbeat_timeout_in_ms=milliseconds)


def pending_closures(coordinator):
    """A `ClusterCoordinator`'s closures queued or running ("pending_closures": its own queue;
    TF 2.21 has no count)."""
    using("pending_closures")
    q = coordinator._cluster.closure_queue
    with q._queue_lock:
        return q._queue.qsize() + q._inflight_closure_count


def xspace():
    """An empty XSpace, the protobuf TF's profiler writes (`*.xplane.pb`): "xspace". TF has no
    public reader for it (TensorBoard's profile plugin parses it with this same generated
    module); `tensorflow.tsl.profiler.protobuf` is where the TF 2.21 wheel ships it."""
    using("xspace")
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    return xplane_pb2.XSpace()


def slurm_tasks_per_node(text):
    """`SLURM_TASKS_PER_NODE` ('2(x3),1') as a list of counts, parsed by TF's Slurm resolver
    ("slurm_tasks_per_node")."""
    using("slurm_tasks_per_node")
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm
    return slurm.expand_tasks_per_node(text)


class Tensors(tf.__internal__.tracking.Trackable):
    """A value that `tf.train.Checkpoint` saves as one tensor (under the key a variable's value
    has) and restores from one ("trackable_tensors"). A subclass defines `value()`, the tensor
    to save, and `restore(tensor)`, the op that sets it. tfdist's tensor-parallel layers show
    the unsplit kernel this way, so that a checkpoint restores into any number of shards."""

    def __init__(self):
        using("trackable_tensors")

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.value()}

    def _restore_from_tensors(self, restored_tensors):
        return self.restore(restored_tensors["VARIABLE_VALUE"])


def tf_runtime_started():
    """Whether TensorFlow's runtime has started in this process: its eager context initialised
    (thread pools, devices, servers) ("runtime_started"). TF has no public query: tf.config's
    setters raise only when asked to change something once it has."""
    using("runtime_started")
    from tensorflow.python.eager import context
    ctx = context.context_safe()
    return ctx is not None and bool(ctx._initialized)
