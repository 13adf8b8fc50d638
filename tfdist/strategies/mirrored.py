"""`mirrored`: synchronous data parallelism over the devices of one machine (MirroredStrategy).

On a machine without GPUs, `devices=N` splits the CPU into N logical devices, one replica each
(useful for tests and for checking a multi-replica set-up before it goes to GPUs). With GPUs,
`devices=N` uses the first N (0: all).
"""
from tfdist.parallel.layout import configure_logical_cpus
from tfdist.runtime.lazy import tf
from tfdist.strategies.base import Strategy

_CROSS_DEVICE_OPS = {
    "auto": lambda: None,  # TF's choice: NCCL on GPUs, collective ring on CPU devices
    "reduce_to_one": lambda: tf.distribute.ReductionToOneDevice(),
    "hierarchical": lambda: tf.distribute.HierarchicalCopyAllReduce(),
}


class Mirrored(Strategy):
    name = "mirrored"
    supports_jit_compile = False  # TF 2.21: XLA cannot access resources across replicas' devices
    uses_local_devices = True
    options = {
        "devices": (0, lambda v: isinstance(v, int) and 0 <= v <= 64,
                    "an integer in [0, 64] (on CPU: logical devices to split it into; "
                    "0 = as found)"),
        "cross_device_ops": ("auto", lambda v: v in _CROSS_DEVICE_OPS,
                             "one of " + ", ".join(_CROSS_DEVICE_OPS)),
    }

    def __init__(self, devices=0, cross_device_ops="auto", **unused_options):
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            names = [f"/gpu:{i}" for i in range(len(gpus))][:devices or None]
        else:
            if devices > 1:
                configure_logical_cpus(devices)
            names = [d.name for d in tf.config.list_logical_devices("CPU")]
        super().__init__(tf.distribute.MirroredStrategy(
            devices=names, cross_device_ops=_CROSS_DEVICE_OPS[cross_device_ops]()))
