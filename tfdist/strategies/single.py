"""`single`: one replica on one device (the first GPU if there is one, else the CPU)."""
import tensorflow as tf

from tfdist.strategies.base import Strategy


class SingleDevice(Strategy):
    name = "single"

    def __init__(self, **unused_options):
        device = "/gpu:0" if tf.config.list_physical_devices("GPU") else "/cpu:0"
        super().__init__(tf.distribute.OneDeviceStrategy(device))
