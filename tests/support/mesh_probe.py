"""A Keras program on tfdist's mesh (tests/test_mesh.py): keras-hub's Llama or a plain functional
model under `keras.distribution.ModelParallel`, against the same program on one device.

    python tests/support/mesh_probe.py llama --mesh=2x2 --out=result.json
    tfdist launch --workers 2 -- python tests/support/mesh_probe.py llama --mesh=2x2 --out=...

Writes (the chief, process 0) JSON: each run's per-step losses, the largest difference of their
predictions and of the logits of the model saved on the mesh and loaded on one device, whether
greedy generation gave the same tokens, and each variable's bytes on each of this process's
devices beside what its layout says.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

p = argparse.ArgumentParser()
p.add_argument("model", choices=["llama", "plain", "plain_nomatch", "gpt2", "gpt_llama", "embed"])
p.add_argument("--mesh", default="1x2")
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--no-reference", action="store_true")
p.add_argument("--backup", default="", help="a BackupAndRestore directory (resume test)")
p.add_argument("--save-freq", default="epoch", help="the BackupAndRestore's save_freq")
p.add_argument("--die-after", type=int, default=0, help="SIGKILL itself after this many steps")
p.add_argument("--plan", default="", help="gpt_llama: a per-layer plan's layout_map.json "
               "(tfdist plan --per_layer) instead of tfdist's whole map")
p.add_argument("--vocab", type=int, default=64, help="gpt_llama's vocabulary")
p.add_argument("--data-parallel", action="store_true",
               help="keras.distribution.DataParallel over every device instead of ModelParallel")
p.add_argument("--one-function", action="store_true",
               help="also run Keras's train_step as one DTensor function: do the weights move?")
args = p.parse_args()
shape = tuple(int(s) for s in args.mesh.split("x"))
workers = len(json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {}).get("worker", []))

from tfdist.parallel import mesh  # noqa: E402

mesh.enable(cpu_devices=int(np.prod(shape)) // max(workers, 1))

import keras  # noqa: E402

from tfdist.parallel.mesh import layouts  # noqa: E402

rng = np.random.default_rng(0)
tokens = rng.integers(0, 64, (8, 9)).astype("int32")  # (ids below every model's vocabulary)


def llama():
    import keras_hub
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def plain():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="down")(hidden))


def embed():
    """A plain model with a vocabulary of 4096 (the per-layer plan's test: tests/test_layers.py)."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(4096, 16, name="embed")(inputs)
    h = keras.layers.Dense(32, activation="relu", name="up")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="down")(h))


def tfdist_gpt():
    from tfdist.models.gpt import GPT
    keras.utils.set_random_seed(1)
    arch = "gpt2" if args.model == "gpt2" else "llama"
    recompute = json.load(open(args.plan)).get("recompute", []) if args.plan else []
    return GPT(vocab_size=args.vocab, block_size=8, recompute=recompute, n_layer=2, n_head=4,
               n_embd=16, arch=arch, **({"n_kv_head": 2} if arch == "llama" else {}))


if args.model in ("gpt2", "gpt_llama"):
    build, x, y = tfdist_gpt, tokens[:, :-1], tokens[:, 1:]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
elif args.model == "llama":
    build, x, y = llama, {"token_ids": tokens[:, :-1], "padding_mask": np.ones((8, 8), "int32")}, \
        tokens[:, 1:]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
elif args.model == "embed":
    build, x, y = embed, tokens[:, :-1], rng.normal(size=(8, 8, 4)).astype("float32")
    loss = "mse"
else:
    build, x, y = plain, rng.normal(size=(8, 12)).astype("float32"), \
        rng.normal(size=(8, 4)).astype("float32")
    loss = "mse"


def layout_map(device_mesh):
    if args.model in ("gpt2", "gpt_llama"):
        from tfdist.models import gpt
        if args.plan:  # a per-layer plan's map (tfdist plan --per_layer)
            from tfdist.plan import layers
            return layers.to_layout_map(args.plan, device_mesh)
        return gpt.layout_map(device_mesh)
    if args.model == "llama":
        import keras_hub
        return keras_hub.models.LlamaBackbone.get_layout_map(device_mesh)
    if args.model == "embed":  # a per-layer plan's map (tfdist.plan.layers.keras_plan)
        from tfdist.plan import layers
        return layers.to_layout_map(args.plan, device_mesh)
    layout = keras.distribution.LayoutMap(device_mesh)
    if args.model == "plain":
        layout["up/kernel"] = (None, "model")
        layout["down/kernel"] = ("model", None)
    else:
        layout["nothing/kernel"] = (None, "model")
    return layout


class Losses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))
        marker = os.path.join(os.path.dirname(os.path.abspath(args.out)), "killed-once")
        if (args.die_after and len(self.losses) == args.die_after and not os.path.exists(marker)
                and os.environ.get("DTENSOR_CLIENT_ID") == "1"):
            open(marker, "w").close()  # a dead worker, once: the restarted group resumes
            os.kill(os.getpid(), 9)


def train(model, backup=False):
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    losses = Losses()
    callbacks = [losses]
    if backup:  # (before the losses: a kill at a step's end comes after its epoch's backup)
        save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
        callbacks.insert(0, keras.callbacks.BackupAndRestore(args.backup, save_freq=save_freq))
    model.fit(x, y, batch_size=8, epochs=args.steps, verbose=0, shuffle=False,
              callbacks=callbacks)
    evaluated = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    return losses.losses + [evaluated["loss"]], model.predict(x, batch_size=8, verbose=0)


def sharding(model):
    """Each variable's bytes on each of this process's devices, beside what its layout says."""
    out = {}
    for v in model.weights:
        storage = v.value
        spec = storage.layout.sharding_specs
        sizes = layouts.sizes_of(device_mesh)
        split = int(np.prod([sizes[a] for a in spec if a in sizes]))
        whole = int(np.prod(v.shape)) * storage.dtype.size
        out[v.path] = {"spec": list(spec), "whole": whole, "expected": whole // split,
                       "devices": layouts.shard_bytes(storage)}
    return out


device_mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"),
                                            keras.distribution.list_devices())
if args.data_parallel:
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        keras.distribution.DeviceMesh((int(np.prod(shape)),), ("batch",),
                                      keras.distribution.list_devices())))
else:
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=layout_map(device_mesh), batch_dim_name="batch"))
model = build()
result = {"devices": keras.distribution.list_devices()}
placed = keras.distribution.distribute_tensor(  # Keras's own call: rows over the first axis
    np.arange(8 * 4, dtype="float32").reshape(8, 4),
    keras.distribution.TensorLayout((device_mesh.axis_names[-1], None), device_mesh))
result["distributed_tensor"] = {"devices": layouts.shard_bytes(placed),
                                "whole": bool((layouts.to_local(placed).numpy()
                                               == np.arange(32).reshape(8, 4)).all())}
if args.one_function:  # what tfdist's two functions avoid (tfdist/parallel/mesh/step.py)
    import tensorflow as tf

    from tfdist.parallel.mesh import step
    once = build()
    once.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    batch = next(step.batches(once, [(x, y)]))  # built, and on the mesh
    before = [w.numpy() for w in once.trainable_weights]
    tf.function(once.train_step)(batch)
    result["one_function_moved"] = float(max(
        np.abs(w.numpy() - b).max() for w, b in zip(once.trainable_weights, before)))
result["mesh_losses"], mesh_predictions = train(model, backup=bool(args.backup))
result["sharding"] = sharding(model)  # (tfdist's GPT is built by its first batch)
prompt = None
if args.model == "llama":
    model.compile(sampler="greedy")
    prompt = {"token_ids": np.concatenate([tokens[:, :4], np.zeros((8, 4), "int32")], 1),
              "padding_mask": np.concatenate([np.ones((8, 4), "int32"),
                                              np.zeros((8, 4), "int32")], 1)}
    mesh_tokens = model.generate(prompt, max_length=8, stop_token_ids=None)["token_ids"]
saved = os.path.splitext(os.path.abspath(args.out))[0] + ".keras"
model.save(saved)  # every process: reading the variables is collective; process 0 writes

if not args.no_reference:
    keras.distribution.set_distribution(None)
    import tfdist.strategies
    with tfdist.strategies.get("single").scope():
        reference = build()
        result["reference_losses"], predictions = train(reference)
    result["predict_difference"] = float(np.abs(mesh_predictions - predictions).max())
    if prompt is not None:
        reference.compile(sampler="greedy")
        tokens_there = reference.generate(prompt, max_length=8, stop_token_ids=None)["token_ids"]
        result["generate_equal"] = bool((mesh_tokens == tokens_there).all())
    if int(os.environ.get("DTENSOR_CLIENT_ID", "0")) == 0:
        loaded = keras.saving.load_model(saved)
        result["loaded_difference"] = float(
            np.abs(loaded.predict(x, batch_size=8, verbose=0) - mesh_predictions).max())
if int(os.environ.get("DTENSOR_CLIENT_ID", "0")) == 0:
    with open(args.out, "w") as f:
        json.dump(result, f)
