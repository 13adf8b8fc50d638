"""`multi_worker_mirrored`: synchronous data parallelism across processes (collective all-reduce).

The cluster comes from TF_CONFIG (set by `tfdist launch`, a Kubernetes TFJob, or by hand) or from
Slurm. Building the strategy blocks until every worker is up. Keras 3 `fit` needs two upstream
corrections here (keras-team/keras#20585), applied from `tfdist.compat`.
"""
import tensorflow as tf

from tfdist import cluster as cluster_lib
from tfdist import compat
from tfdist.errors import UsageError
from tfdist.strategies.base import Launch, Strategy

_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
}


class MultiWorkerMirrored(Strategy):
    name = "multi_worker_mirrored"
    supports_jit_compile = False
    options = {"cross_device_ops": ("auto", lambda v: v in _IMPLEMENTATIONS,
                                    "one of " + ", ".join(_IMPLEMENTATIONS))}
    launch = Launch()  # N workers with TF_CONFIG; any failure restarts the group

    @classmethod
    def plan_command(cls, device, processes, per_node, flags):
        if processes == 1 or device.startswith("tpu"):
            return None
        if processes <= per_node:
            return f"tfdist launch --workers {processes} -- " + " ".join(flags)
        return (f"sbatch --nodes={-(-processes // per_node)} --ntasks-per-node={per_node} "
                f"launchers/slurm/tfdist.sbatch " + " ".join(flags))

    def __init__(self, cross_device_ops="auto", cluster=None, **unused_options):
        self.cluster = cluster or cluster_lib.from_environment(allowed_roles=("chief", "worker"))
        if self.cluster is None:
            raise UsageError("multi_worker_mirrored needs a cluster: set TF_CONFIG, run in a Slurm "
                             "job step, or start the workers with `tfdist launch`")
        compat.fix_fit_under_multi_worker()
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=_IMPLEMENTATIONS[cross_device_ops])
        super().__init__(tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=self.cluster.resolver(), communication_options=options))

    @property
    def is_chief(self):
        return self.cluster.is_chief

    @property
    def worker_index(self):
        return self.cluster.worker_index

    @property
    def num_workers(self):
        return self.cluster.num_workers

    def describe(self):
        return (f"{self.name}: worker {self.worker_index} of {self.num_workers}, "
                f"{self.num_replicas} replica(s) in sync")
