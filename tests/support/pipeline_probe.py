"""Run by tests/test_pipeline.py in a fresh process (the CPU must be split into logical devices
before TF starts). Prints one `PROBE {...}` JSON line.

    python tests/support/pipeline_probe.py grads  K M [recompute] [t=T] [schedule=1f1b]
                                                   # pipelined (and tensor-parallel) vs unsplit
    python tests/support/pipeline_probe.py schedules K M [t=T]     # 1F1B vs GPipe gradients
    python tests/support/pipeline_probe.py losses K M [t=T] [sp [without_reduce_scatter]]
                                                   # 10 fit steps, split vs unsplit
    python tests/support/pipeline_probe.py placement K M           # devices of variables and of ops
    python tests/support/pipeline_probe.py tensor_placement K M t=T  # where each shard's ops ran
    python tests/support/pipeline_probe.py zero3 K M [recompute] [t=T] [sp] [schedule=1f1b]
                                                   [reuse_reads]
                                                   # one replica's ZeRO-3 gradients vs plain's
"""
import json
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist.strategies  # noqa: E402
from tfdist.models import state  # noqa: E402
from tfdist.models.gpt import GPT, loss_fn  # noqa: E402
from tfdist.models.pipeline import Pipeline  # noqa: E402
from tfdist.parallel.layout import Layout, configure_logical_cpus  # noqa: E402
from tfdist.step import TrainStep  # noqa: E402

SIZES = dict(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32)


def models(k, m, recompute=False, t=1, schedule="gpipe", sp=False):
    keras.utils.set_random_seed(0)
    plain = GPT(**SIZES)
    plain.build()
    keras.utils.set_random_seed(0)
    with tfdist.strategies.get("single").scope():  # as `tfdist train` builds it
        piped = Pipeline(GPT(**SIZES), stages=k, microbatches=m, recompute=recompute,
                         tensor_parallel=t, schedule=schedule, sequence_parallel=sp)
        piped.build()
    return plain, piped


def attach_step(piped):
    """tfdist's training step for `piped` (compiled), as `tfdist train` attaches it."""
    layout = Layout(pp=piped.stages, tp=piped.tensor_parallel, microbatches=piped.microbatches,
                    schedule=piped.schedule, recompute=piped.recompute,
                    sp=piped.sequence_parallel, seq=SIZES["block_size"])
    with tfdist.strategies.get("single").scope():
        piped.train_step = TrainStep(piped, tfdist.strategies.get("single"), layout)


def max_abs_diff(a, b):
    """Largest difference between two {name: tensor} dicts with the same names."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.max(np.abs(np.asarray(a[n]) - np.asarray(b[n])))) for n in a)


def batch(n=8, seed=1):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, size=(n, SIZES["block_size"] + 1)).astype("int32")
    return tf.constant(w[:, :-1]), tf.constant(w[:, 1:])


def grads(k, m, recompute=False, t=1, schedule="gpipe"):
    plain, piped = models(k, m, recompute, t, schedule)
    x, y = batch()
    same = {n: state.value_of(v) for n, v in state.weights(plain).items()}
    assert max_abs_diff(same, {n: state.value_of(v) for n, v in state.weights(piped).items()}) == 0
    piped.compile(optimizer="sgd", loss=loss_fn())
    plain_loss = loss_fn()
    with tf.GradientTape() as tape:
        ref_loss = plain_loss(y, plain(x, training=True))
    ref = state.by_name(plain, tape.gradient(ref_loss, plain.trainable_weights))
    loss, got = tf.function(piped.compute_gradients)(x, y)
    got = state.by_name(piped, got)
    return {"loss_diff": abs(float(loss) - float(ref_loss)),
            "max_grad_diff": max_abs_diff(ref, got),
            "max_grad": max(float(np.max(np.abs(g.numpy()))) for g in ref.values()),
            "n": len(got), "shards": len(piped.trainable_weights)}


def schedules(k, m, t=1):
    """1F1B's gradients against GPipe's, same model and batch."""
    x, y = batch()
    out = {}
    for schedule in ("gpipe", "1f1b"):
        _, piped = models(k, m, t=t, schedule=schedule)
        piped.compile(optimizer="sgd", loss=loss_fn())
        loss, got = tf.function(piped.compute_gradients)(x, y)
        out[schedule] = (float(loss), state.by_name(piped, got))
    return {"loss_diff": abs(out["gpipe"][0] - out["1f1b"][0]),
            "max_grad_diff": max_abs_diff(out["gpipe"][1], out["1f1b"][1]),
            "n": len(out["1f1b"][1])}


def losses(k, m, t=1, optimizer="sgd", sp=False):
    """SGD by default: Adam divides by sqrt(v), so a gradient element of 1e-8 moves its weight
    as much as a large one, and float rounding in the gradient (1e-8) becomes 1e-4 in the loss.
    With `sp`, also the same pipeline without sequence parallelism ("tensor")."""
    plain, piped = models(k, m, t=t, sp=sp)
    runs = [("plain", plain), ("pipeline", piped)]
    if sp:
        runs.append(("tensor", models(k, m, t=t)[1]))
    out = {}
    xs, ys = zip(*[batch(seed=s) for s in range(10)])
    ds = tf.data.Dataset.from_tensor_slices((tf.stack(xs), tf.stack(ys)))
    for name, model in runs:
        opt = keras.optimizers.SGD(0.5) if optimizer == "sgd" else keras.optimizers.Adam(1e-3)
        model.compile(optimizer=opt, loss=loss_fn())
        if model is not plain:
            attach_step(model)
        h = model.fit(ds, epochs=10, steps_per_epoch=1, verbose=0, shuffle=False)
        out[name] = [float(v) for v in h.history["loss"]]
    diff = lambda a, b: max(abs(x - y) for x, y in zip(out[a], out[b]))  # noqa: E731
    return {**out, "max_diff": diff("plain", "pipeline"), "describe": piped.describe(),
            **({"sp_vs_tensor": diff("pipeline", "tensor")} if sp else {})}


def zero3_grads(k, m, recompute=False, t=1, schedule="gpipe", sp=False):
    """One replica's ZeRO-3 gradients (tfdist.parallel.zero.weights: each block run with its
    gathered weights under a custom gradient, the tied head's read gathered where it is read)
    against the same pipeline's plain gradients. (One replica: no collective; what is checked is
    that every weight's gradient reaches it through the gathers, stage recomputation included.)"""
    from tfdist.parallel import zero
    x, y = batch()

    def gradients(piped, sources):
        return tf.function(lambda: piped.compute_gradients(x, y, variables=sources))()

    out = []
    for sharded in (False, True):
        _, piped = models(k, m, recompute, t, schedule, sp)
        piped.compile(optimizer="sgd", loss=loss_fn())
        sources = zero.make(3, piped, zero.local()).sources() if sharded \
            else list(piped.trainable_weights)
        loss, got = gradients(piped, sources)
        grads = dict(zip(map(id, sources), got))
        out.append((float(loss), state.by_name(piped, [grads[id(v)] for v in
                                                       piped.trainable_weights])))
    return {"loss_diff": abs(out[0][0] - out[1][0]), "max_grad_diff": max_abs_diff(
        out[0][1], out[1][1]), "n": len(out[1][1])}


def placement(k, m):
    _, piped = models(k, m)
    piped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss_fn())
    x, y = batch()
    attach_step(piped)  # (it builds the optimizer)
    variables = {v.path: tf.DeviceSpec.from_string(v.value.device).device_index
                 for v in piped.weights}
    slots = {v.path: tf.DeviceSpec.from_string(v.value.device).device_index
             for v in piped.optimizer.variables if len(v.shape) > 0}
    step = tf.function(lambda: piped.train_step((x, y)))
    graph = step.get_concrete_function().graph
    # The device every block's forward and backward ops asked for (tf.device in the forward,
    # tf.gradients' colocation in the backward), by the block's name scope; and the devices of
    # the optimizer's update math.
    block_ops, update_ops = {}, {}
    for op in graph.get_operations():
        index = tf.DeviceSpec.from_string(op.device).device_index if op.device else None
        found = re.search(r"/h_(\d+)(?:_\d+)?/", op.name)
        if op.type in ("ReadVariableOp", "Placeholder", "Const", "NoOp"):
            continue  # a variable read runs where its variable is; constants anywhere
        if found:
            entry = block_ops.setdefault(int(found.group(1)), {"forward": set(), "backward": set()})
            entry["backward" if op.name.startswith("gradients/") else "forward"].add(index)
        elif op.name.startswith("adam/") and op.type not in ("Const", "ReadVariableOp",
                                                              "Placeholder"):
            update_ops.setdefault(str(index), 0)
            update_ops[str(index)] += 1
    return {"stage_blocks": piped.stage_blocks, "devices": piped.devices,
            "variables": variables, "slots": slots,
            "block_ops": {b: {k_: sorted(v, key=str) for k_, v in e.items()}
                          for b, e in sorted(block_ops.items())},
            "update_ops": update_ops}

def tensor_placement(k, m, t):
    """Where each tensor-parallel shard's variables are (read from the variables) and where its
    matmuls ran (TF's partition graphs of an executed train step, after placement), with the
    bytes of each block's matmul weights per device."""
    from tensorflow.python.eager import context
    _, piped = models(k, m, t=t)
    piped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss_fn())
    attach_step(piped)
    x, y = batch()
    ctx = context.context()
    ctx.enable_run_metadata()  # before the first call: partition graphs are kept at instantiation
    tf.function(lambda: piped.train_step((x, y)))()
    meta = ctx.export_run_metadata()
    ctx.disable_run_metadata()
    index = lambda device: tf.DeviceSpec.from_string(device).device_index  # noqa: E731
    want = {(b, r): index(piped.stage_devices[s][r]) for s, blocks in enumerate(piped.stage_blocks)
            for b in blocks for r in range(t)}
    ran = {}  # "block/shard/forward|backward" -> devices its matmuls ran on
    for graph in meta.function_graphs:
        for part in graph.partition_graphs:
            for node in part.node:
                found = re.search(r"/h_(\d+)/tp(\d+)(?:_\d+)?/", node.name)
                if found and "MatMul" in node.op:
                    key = f"{found.group(1)}/{found.group(2)}/" + \
                        ("backward" if "gradients" in node.name else "forward")
                    ran.setdefault(key, set()).add(index(node.device))
    matmul_bytes = {}  # "block/device" -> bytes of the block's matmul kernels there
    for v in piped.weights:
        found = re.search(r"h_(\d+)/.*kernel", v.path)
        if found:
            key = f"{found.group(1)}/{index(v.value.device)}"
            matmul_bytes[key] = matmul_bytes.get(key, 0) + int(np.prod(v.shape)) * 4
    return {"want": {f"{b}/{r}": d for (b, r), d in want.items()},
            "ran": {key: sorted(d) for key, d in ran.items()}, "matmul_bytes": matmul_bytes,
            "unsplit_block_matmul_bytes": 4 * 12 * SIZES["n_embd"] ** 2,
            "memory": piped.memory_estimate(8)}


if __name__ == "__main__":
    what, k, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    words = sys.argv[4:]
    options = dict(w.split("=", 1) for w in words if "=" in w)
    t = int(options.get("t", 1))
    configure_logical_cpus(max(k * t, 1))
    if what == "grads":
        result = grads(k, m, recompute="recompute" in words, t=t,
                       schedule=options.get("schedule", "gpipe"))
    elif what == "schedules":
        result = schedules(k, m, t)
    elif what == "losses":
        if "without_reduce_scatter" in words:  # a test's companion: each chunk keeps only its own
            from tfdist.models import tensor_parallel  # device's partial output, not the sum
            tensor_parallel._reduce_scatter = lambda parts, devices: [
                p[:, r * p.shape[1] // len(devices):(r + 1) * p.shape[1] // len(devices)]
                for r, p in enumerate(parts)]
        result = losses(k, m, t, sp="sp" in words)
    elif what == "zero3":
        if "reuse_reads" in words:  # a test's companion: a lazy read reused across microbatches
            from tfdist.parallel.zero.weights import Gathering
            init = Gathering.__init__
            Gathering.__init__ = lambda self, sharded, mapping=None, reuse=True: init(
                self, sharded, mapping, True)
        result = zero3_grads(k, m, "recompute" in words, t, options.get("schedule", "gpipe"),
                             "sp" in words)
    elif what == "tensor_placement":
        result = tensor_placement(k, m, t)
    else:
        result = placement(k, m)
    print("PROBE " + json.dumps(result), flush=True)
