"""Run by tests/test_pipeline.py in a fresh process (the CPU must be split into logical devices
before TF starts). Prints one `PROBE {...}` JSON line.

    python tests/pipeline_probe.py grads  K M [recompute]   # pipelined vs unsplit gradients
    python tests/pipeline_probe.py losses K M               # 10 fit steps, pipelined vs unsplit
    python tests/pipeline_probe.py placement K M            # devices of variables and of ops
"""
import json
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist.strategies  # noqa: E402
from tfdist.models.gpt import GPT, loss_fn  # noqa: E402
from tfdist.models.pipeline import Pipeline  # noqa: E402
from tfdist.strategies.base import configure_logical_cpus  # noqa: E402

SIZES = dict(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32)


def models(k, m, recompute=False):
    keras.utils.set_random_seed(0)
    plain = GPT(**SIZES)
    plain.build()
    keras.utils.set_random_seed(0)
    with tfdist.strategies.get("single").scope():  # as `tfdist train` builds it
        piped = Pipeline(GPT(**SIZES), stages=k, microbatches=m, recompute=recompute)
        piped.build()
    return plain, piped


def batch(n=8, seed=1):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, size=(n, SIZES["block_size"] + 1)).astype("int32")
    return tf.constant(w[:, :-1]), tf.constant(w[:, 1:])


def grads(k, m, recompute=False):
    plain, piped = models(k, m, recompute)
    x, y = batch()
    for a, b in zip(plain.weights, piped.weights):
        assert np.array_equal(a.numpy(), b.numpy()), (a.path, b.path)  # same initial weights
    piped.compile(optimizer="sgd", loss=loss_fn())
    plain_loss = loss_fn()
    with tf.GradientTape() as tape:
        ref_loss = plain_loss(y, plain(x, training=True))
    ref = tape.gradient(ref_loss, plain.trainable_weights)
    loss, got = tf.function(piped.compute_gradients)(x, y)
    diffs = [float(np.max(np.abs(tf.convert_to_tensor(a).numpy() - tf.convert_to_tensor(b).numpy())))
             for a, b in zip(ref, got)]
    return {"loss_diff": abs(float(loss) - float(ref_loss)), "max_grad_diff": max(diffs),
            "max_grad": max(float(np.max(np.abs(tf.convert_to_tensor(a).numpy()))) for a in ref),
            "n": len(diffs)}


def losses(k, m, optimizer="sgd"):
    """SGD by default: Adam divides by sqrt(v), so a gradient element of 1e-8 moves its weight
    as much as a large one, and float rounding in the gradient (1e-8) becomes 1e-4 in the loss."""
    plain, piped = models(k, m)
    out = {}
    xs, ys = zip(*[batch(seed=s) for s in range(10)])
    ds = tf.data.Dataset.from_tensor_slices((tf.stack(xs), tf.stack(ys)))
    for name, model in (("plain", plain), ("pipeline", piped)):
        opt = keras.optimizers.SGD(0.5) if optimizer == "sgd" else keras.optimizers.Adam(1e-3)
        model.compile(optimizer=opt, loss=loss_fn())
        h = model.fit(ds, epochs=10, steps_per_epoch=1, verbose=0, shuffle=False)
        out[name] = [float(v) for v in h.history["loss"]]
    return {"plain": out["plain"], "pipeline": out["pipeline"],
            "max_diff": max(abs(a - b) for a, b in zip(out["plain"], out["pipeline"]))}


def placement(k, m):
    _, piped = models(k, m)
    piped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss_fn())
    x, y = batch()
    piped.optimizer.build(piped.trainable_weights)
    variables = {v.path: tf.DeviceSpec.from_string(v.value.device).device_index
                 for v in piped.weights}
    slots = {v.path: tf.DeviceSpec.from_string(v.value.device).device_index
             for v in piped.optimizer.variables if len(v.shape) > 0}
    step = tf.function(lambda: piped.train_step((x, y)))
    graph = step.get_concrete_function().graph
    # The device every block's forward and backward ops asked for (tf.device in the forward,
    # tf.gradients' colocation in the backward), by the block's name scope; and the devices of
    # the optimizer's update math.
    block_ops, update_ops, unplaced = {}, {}, 0
    for op in graph.get_operations():
        index = tf.DeviceSpec.from_string(op.device).device_index if op.device else None
        found = re.search(r"/h_(\d+)(?:_\d+)?/", op.name)
        if op.type in ("ReadVariableOp", "Placeholder", "Const", "NoOp"):
            continue  # a variable read runs where its variable is; constants anywhere
        if found:
            entry = block_ops.setdefault(int(found.group(1)), {"forward": set(), "backward": set()})
            entry["backward" if op.name.startswith("gradients/") else "forward"].add(index)
        elif op.name.startswith("adam/") and op.type not in ("Const", "ReadVariableOp", "Placeholder"):
            update_ops.setdefault(str(index), 0)
            update_ops[str(index)] += 1
    return {"stage_blocks": piped.stage_blocks, "devices": piped.devices,
            "variables": variables, "slots": slots,
            "block_ops": {b: {k_: sorted(v, key=str) for k_, v in e.items()}
                          for b, e in sorted(block_ops.items())},
            "update_ops": update_ops}

if __name__ == "__main__":
    what, k, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    configure_logical_cpus(max(k, 1))
    if what == "grads":
        result = grads(k, m, recompute=len(sys.argv) > 4 and sys.argv[4] == "recompute")
    elif what == "losses":
        result = losses(k, m, *sys.argv[4:])
    else:
        result = placement(k, m)
    print("PROBE " + json.dumps(result), flush=True)
