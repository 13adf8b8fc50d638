"""`single`: one replica on one device (the first GPU if there is one, else the CPU).

On one GPU it is `OneDeviceStrategy` (which prefetches each batch to the GPU). Elsewhere it is
TF's default strategy, which puts unplaced ops on the first GPU, else the CPU, as
`OneDeviceStrategy` would:
* on a CPU, where `OneDeviceStrategy` only adds work: its step runs as a multi-device function
  fed by a multi-device iterator, 8 % of a `gpt_demo` step here (tools/bench/peer.py);
* when the process has been given several devices for one replica (a pipeline's stages on
  logical CPUs, or several GPUs): `OneDeviceStrategy` creates every variable on its own device,
  whatever `tf.device` the model asks for, and would put all of a pipeline's stages on one
  device. The default strategy leaves placement to the model.
"""
from tfdist.runtime.lazy import tf
from tfdist.strategies.base import Strategy


class SingleDevice(Strategy):
    name = "single"
    runs_keras_accumulation = True  # one replica: no merge_call

    @classmethod
    def plan_command(cls, device, processes, per_node, flags):
        if processes == 1 and not device.startswith("tpu"):
            return "tfdist train " + " ".join(flags)
        return None

    def describe(self):
        if isinstance(self.tf_strategy, tf.distribute.OneDeviceStrategy):
            return super().describe()
        if self.split:
            return f"{self.name}: 1 replica, placed by the model over this process's devices"
        return f"{self.name}: 1 replica on /cpu:0"

    def keras_call(self, method, model, upstream, arguments):
        # Under TF's default strategy Keras's fit builds a subclassed model only at its first
        # step, after the callbacks' start, where BackupAndRestore refuses an unbuilt model;
        # under OneDeviceStrategy Keras built it first, so a user's program built it here too.
        if method == "fit" and not model.built:
            from tfdist import compat
            compat.build_for(model, arguments.get("x"))
        return super().keras_call(method, model, upstream, arguments)

    def __init__(self, **unused_options):
        gpus = tf.config.list_physical_devices("GPU")
        # Reads the configuration only: TF's runtime is not started here.
        split = tf.config.get_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0])
        self.split = len(gpus) > 1 or bool(split and len(split) > 1)
        if self.split or not gpus:
            super().__init__(tf.distribute.get_strategy())
            return
        super().__init__(tf.distribute.OneDeviceStrategy("/gpu:0"))
