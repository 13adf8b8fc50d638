"""Bad input to tfdist's mesh (tests/test_mesh.py): each case must end in one line and exit 2.

    python tests/support/mesh_bad.py CASE
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

case = sys.argv[1]
from tfdist.parallel import mesh  # noqa: E402

mesh.enable(cpu_devices=3 if case == "not_dividing" else 2)
import keras  # noqa: E402

devices = keras.distribution.list_devices()
if case == "larger_mesh":  # 4 places on 2 devices: Keras's own check
    device_mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices)
elif case == "missing_device":  # the right number of names, one a device there is not
    device_mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:7"])
else:
    device_mesh = keras.distribution.DeviceMesh((1, len(devices)), ("batch", "model"), devices)
layout_map = keras.distribution.LayoutMap(device_mesh)
layout_map["up/kernel"] = (None, "model")
keras.distribution.set_distribution(keras.distribution.ModelParallel(
    layout_map=layout_map, batch_dim_name="batch"))
if case == "with_zero":
    import tfdist.strategies
    strategy = tfdist.strategies.get("horovod", zero=3)
    with strategy.scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(16, name="up")(inputs))
        model.compile(optimizer="adam", loss="mse")
inputs = keras.Input((4,))
model = keras.Model(inputs, keras.layers.Dense(16, name="up")(inputs))  # 16 columns over 3
model.compile(optimizer="adam", loss="mse")
print("no error", flush=True)
