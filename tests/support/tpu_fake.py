"""A TPUClusterResolver that reports a TPU system without one (DESIGN.md): enough to build a
TPUStrategy and exercise tfdist's Python paths. Nothing can run on its devices."""
import tensorflow as tf
from tensorflow.python.client import session
from tensorflow.python.tpu import tpu_system_metadata


class FakeResolver(tf.distribute.cluster_resolver.TPUClusterResolver):
    def __init__(self, cores=8):
        super().__init__(tpu="local")
        self.cores = cores

    def get_tpu_system_metadata(self):
        devices = [session._DeviceAttributes(f"/job:worker/replica:0/task:0/device:TPU:{i}",
                                             "TPU", 0, 0) for i in range(self.cores)]
        devices.append(session._DeviceAttributes("/job:worker/replica:0/task:0/device:CPU:0",
                                                 "CPU", 0, 0))
        return tpu_system_metadata.TPUSystemMetadata(
            num_cores=self.cores, num_hosts=1, num_of_cores_per_host=self.cores, topology=None,
            devices=devices)
