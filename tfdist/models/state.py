"""A model's training state under the unsplit model's names, whatever its layout.

A plain GPT, a pipeline of K stages and a tensor-parallel GPT hold the same numbers in different
variables: a t-way `ShardedDense` keeps t kernel shards where the GPT has one kernel, and Adam
keeps a slot per shard. Checkpoints written through this module hold one entry per variable of the
*unsplit* model, named by its path inside the model ("h_0/attn/c_attn/kernel"), and each optimizer
slot as "<slot list>/<that name>" ("momentums/h_0/attn/c_attn/kernel"); shards are joined on save
and split on restore (`tensor_parallel.ShardedDense.whole`). So a backup of any layout restores into
any other, and its names say what they hold.

Example:

    >>> import tensorflow as tf
    >>> from tfdist.models.gpt import GPT
    >>> from tfdist.models import state
    >>> gpt = GPT(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=32)
    >>> gpt.build()
    >>> names = state.weights(gpt)
    >>> "h_0/attn/c_attn/kernel" in names, tuple(names["wte/embeddings"].shape)
    (True, (256, 32))
"""
import keras
import numpy as np
import tensorflow as tf

from tfdist.models import tensor_parallel


def _name(variable):
    """A variable's path inside its model: the path without the model's own name."""
    return variable.path.split("/", 1)[-1]


def _sharded_layers(model):
    mine = {id(v) for v in model.weights}
    return [layer for layer in list(tensor_parallel.BUILT) if id(layer.kernels[0]) in mine]


def _shard_index(model):
    """id(shard variable) -> (name of the whole, its layer, "kernel" or "bias", shard index)."""
    index = {}
    for layer in _sharded_layers(model):
        base = _name(layer.kernels[0]).rsplit("/", 1)[0]
        for what, shards in (("kernel", layer.kernels), ("bias", layer.biases)):
            for r, v in enumerate(shards):
                index[id(v)] = (f"{base}/{what}", layer, what, r)
    return index


def weights(model):
    """{name: variable, or the tensor-parallel shards shown as one} for every weight of `model`
    (dropout RNG states excepted: tfdist.callbacks saves those by position)."""
    shards = _shard_index(model)
    out = {}
    for v in model.weights:
        if "seed_generator" in v.path:
            continue
        if id(v) in shards:
            name, layer, what, _ = shards[id(v)]
            if name not in out:
                out[name] = layer.whole()[what]
            continue
        out[_unique(out, _name(v))] = v
    return out


def _unique(names, name):
    if name in names:
        raise ValueError(f"two variables are named {name!r}: layout-free state needs unique "
                         f"layer names")
    return name


def _slot_lists(optimizer, own):
    """The optimizer's per-variable lists (Adam's momentums and velocities, accumulated
    gradients): attributes aligned with the trainable variables `own` it was built with."""
    for attr, value in sorted(vars(optimizer).items()):
        if (attr != "_trainable_variables" and isinstance(value, list) and len(value) == len(own)
                and value and all(x is None or isinstance(x, keras.Variable) for x in value)):
            yield attr.strip("_"), value


def optimizer_state(optimizer, model, trainables=None):
    """{name: variable or joined shards} for the optimizer's state: each slot under the name of
    the unsplit variable it belongs to; every other variable (iterations, a loss scale) by its own
    name. A LossScaleOptimizer's inner optimizer is under "inner/". `trainables`: the variables
    the optimizer was built with (default: the model's trainable weights; under ZeRO-3 those this
    replica holds, `tfdist.parallel.zero`)."""
    shards = _shard_index(model)
    out = {}
    placed = set()  # ids of the variables named so far
    trainables = model.trainable_weights if trainables is None else trainables
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        for name, v in optimizer_state(inner, model, trainables).items():
            out["inner/" + name] = v
        placed |= {id(v) for v in inner.variables}
    for slot_name, slots in _slot_lists(optimizer, trainables):
        groups = {}
        for var, slot in zip(trainables, slots):
            if slot is None:
                continue
            placed.add(id(slot))
            if id(var) in shards:
                name, layer, what, r = shards[id(var)]
                groups.setdefault((name, layer, what), {})[r] = slot
            else:
                out[f"{slot_name}/{_name(var)}"] = slot
        for (name, layer, what), by_shard in groups.items():
            parts = [by_shard[r] for r in sorted(by_shard)]
            out[f"{slot_name}/{name}"] = _joined(layer, what, parts)
    for v in optimizer.variables:
        if id(v) not in placed:
            out[_unique(out, _name(v))] = v
    return out


def _joined(layer, what, parts):
    whole = layer.whole()[what]
    return type(whole)(parts, whole.join, whole.split, whole.shape)


def shapes(model):
    """{name: shape} of the unsplit weights: what a checkpoint must match to be restored."""
    return {name: [int(d) for d in v.shape] for name, v in sorted(weights(model).items())}


def value_of(v):
    """A weight's value: a variable's, or tensor-parallel shards' joined."""
    if callable(getattr(v, "value", None)) and not isinstance(v, keras.Variable):
        return v.value()
    return tf.convert_to_tensor(v)


def plain_gpt(model):
    """The unsplit GPT of `model` (a GPT, or a Pipeline of one) holding its weights: the model
    itself when it is a GPT, else a new GPT built on the default device (to save as `model.keras`,
    or to sample from). (A pipeline's own GPT was built stage by stage, not by its `build`, so
    Keras would save it without a build config, and load it without weights.)"""
    gpt = getattr(model, "gpt", model)
    if gpt is model:
        return gpt
    from tfdist.models.gpt import GPT
    plain = GPT.from_config(gpt.get_config())
    plain.build()
    values = {name: value_of(v) for name, v in weights(gpt).items()}
    for name, v in weights(plain).items():
        v.assign(np.asarray(values[name]))
    return plain


def by_name(model, tensors):
    """{name: tensor} for `tensors` aligned with `model.trainable_weights` (its gradients, say),
    tensor-parallel shards joined: what the unsplit model's would be."""
    shards = _shard_index(model)
    out = {}
    parts = {}  # name -> (layer, "kernel" or "bias", {shard index: tensor})
    for v, t in zip(model.trainable_weights, tensors):
        t = tf.convert_to_tensor(t)
        if id(v) in shards:
            name, layer, what, r = shards[id(v)]
            parts.setdefault(name, (layer, what, {}))[2][r] = t
        else:
            out[_name(v)] = t
    for name, (layer, what, by_shard) in parts.items():
        out[name] = layer.join_shards([by_shard[r] for r in sorted(by_shard)], what == "kernel")
    return out
