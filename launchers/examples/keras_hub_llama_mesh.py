"""Keras's own model-parallel program, as a Keras user writes it for JAX, on TensorFlow: keras-hub's
Llama sharded by `LlamaBackbone.get_layout_map` under `keras.distribution.ModelParallel`. The one
tfdist line is `mesh.enable(...)` (docs/parallelism.md, "Keras's distribution API on TensorFlow").

    python launchers/examples/keras_hub_llama_mesh.py --mesh=2x2                # 4 logical CPUs
    tfdist launch --workers 2 -- python launchers/examples/keras_hub_llama_mesh.py --mesh=2x2

A small Llama (random weights, GQA) trains for --steps steps on random tokens, prints its losses
and each kernel's share of its bytes on this process's first device, then greedily continues a
prompt. With `tfdist launch --workers N` the mesh spans the N processes (each N-th of the devices).
"""
import json
import os

import numpy as np
from absl import app, flags

_MESH = flags.DEFINE_string("mesh", "1x2", "The mesh's shape, batch x model.")
_STEPS = flags.DEFINE_integer("steps", 5, "Training steps.")


def main(argv):
    del argv
    shape = tuple(int(n) for n in _MESH.value.split("x"))
    processes = len(json.loads(os.environ.get("TF_CONFIG") or "{}")
                    .get("cluster", {}).get("worker", [])) or 1

    from tfdist.parallel import mesh
    mesh.enable(cpu_devices=shape[0] * shape[1] // processes)  # the one tfdist line

    import keras
    import keras_hub
    device_mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"),
                                                keras.distribution.list_devices())
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(device_mesh),
        batch_dim_name="batch"))

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=256, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=64, intermediate_dim=128)
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  sampler="greedy")

    tokens = np.random.default_rng(0).integers(0, 256, (8 * _STEPS.value, 33)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
    history = model.fit(x, tokens[:, 1:], batch_size=8, epochs=1, shuffle=False)
    print("loss", history.history["loss"])

    for v in model.weights[:4]:  # each device holds its layout's share of the kernel
        shard = v.value.read_value()
        from tensorflow.experimental import dtensor
        first = dtensor.unpack(shard)[0]
        print(f"{v.path:<58} {str(tuple(v.shape)):<14} on {first.device[-5:]}: "
              f"{int(np.prod(first.shape))}/{int(np.prod(v.shape))} of its values")

    prompt = {"token_ids": np.concatenate([tokens[:8, :4], np.zeros((8, 12), "int32")], 1),
              "padding_mask": np.concatenate([np.ones((8, 4), "int32"),
                                              np.zeros((8, 12), "int32")], 1)}
    print("generated", model.generate(prompt, max_length=16, stop_token_ids=None)["token_ids"][0])


if __name__ == "__main__":
    app.run(main)
