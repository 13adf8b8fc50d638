"""Tensor parallelism (Megatron-LM style) for the GPT's blocks over t devices of one process.

Following Shoeybi et al. 2019 (Megatron-LM, section 3), each block's two matmul pairs are split so
that one sum of partial outputs per pair is the only communication:

* attention: `c_attn` is column-parallel *per head*: device r holds the q, k and v columns of heads
  [r*H/t, (r+1)*H/t) and runs their attention; `c_proj` is row-parallel: device r holds the rows
  for its heads' outputs, and the t partial outputs are summed (then the bias is added once);
* MLP: `c_fc` is column-parallel (device r has 4C/t hidden units and applies GELU to them alone),
  `mlp_c_proj` row-parallel, summed in the same way.

Everything else is kept whole, once, on the first device of the group: the LayerNorms, the residual
stream, the embeddings and the tied head. Megatron "replicates" LayerNorms because each GPU is its
own process; in one process a replica per device would only add t-1 copies to keep in sync, and the
inputs of the column-parallel matmuls are copied to each device either way (Megatron's f operator).
With sequence parallelism (`Pipeline(..., sequence_parallel=True)`, Korthikanti et al. 2022) the
LayerNorms, dropouts and residual stream are split along the sequence instead: device r holds
tokens [r*T/t, (r+1)*T/t) of each, the chunks are gathered before each column-parallel matmul and
the partial outputs reduce-scattered after each row-parallel one (`scatter_sequence`); a stage
splits its input at entry and joins its output at exit.
The embedding and head stay whole rather than vocabulary-parallel: the head's logits must be whole
for Keras's loss (a vocabulary-parallel head needs Megatron's fused cross entropy), and on a
pipeline they sit on the first and last stage, which hold fewer blocks (the balanced split counts
them). `tfdist plan` counts the same layout.

Which variables are split, and along which axis, is written in Keras's own distribution vocabulary:
a `keras.distribution.LayoutMap` over a `DeviceMesh` whose tensor axis is named "model"
(`megatron_layout`). The GPT file knows nothing of this: `shard_blocks` swaps each block's Dense
layers for `ShardedDense` layers of the same name, and `parallel_block` runs a block on its devices.
Saved state is layout-free: `ShardedDense.whole()` shows tf.train.Checkpoint the tensors the unsplit
Dense would hold (`tfdist.models.state`).

Example (2 logical CPU devices):

    >>> import numpy as np, tensorflow as tf
    >>> from tfdist.models.gpt import GPT
    >>> from tfdist.models.pipeline import Pipeline
    >>> from tfdist.parallel.layout import configure_logical_cpus
    >>> configure_logical_cpus(2)
    >>> model = Pipeline(GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32),
    ...                  stages=1, tensor_parallel=2)
    >>> model.build()
    >>> print(model.describe())  # doctest: +NORMALIZE_WHITESPACE
    tensor parallel over 2 devices: embed + blocks 0-1 + head on /device:CPU:0 + /device:CPU:1
    >>> c_fc = model.gpt.blocks[0].c_fc
    >>> [tuple(k.shape) for k in c_fc.kernels], tuple(c_fc.whole()["kernel"].value().shape)
    ([(32, 64), (32, 64)], (32, 128))
"""
import weakref

import keras
import tensorflow as tf
from keras import ops

from tfdist import compat

AXIS = "model"  # the DeviceMesh axis the blocks are split over
BUILT = weakref.WeakSet()  # every built ShardedDense (tfdist.models.state finds a model's here)


def megatron_layout(mesh):
    """Which of a block's variables are split over the mesh's "model" axis (Megatron-LM): the
    column-parallel kernels and biases on their output axis, the row-parallel kernels on their
    input axis. Keys are the variables' paths within the GPT; anything unmatched is kept whole."""
    layout = keras.distribution.LayoutMap(mesh)
    for column in ("attn/c_attn", "c_fc"):
        layout[rf"h_\d+/{column}/kernel"] = (None, AXIS)
        layout[rf"h_\d+/{column}/bias"] = (AXIS,)
    for row in ("attn/c_proj", "mlp_c_proj"):
        layout[rf"h_\d+/{row}/kernel"] = (AXIS, None)
    return layout


class _Whole(compat.Tensors):
    """t shard variables shown to tf.train.Checkpoint as the one tensor the unsplit layer holds
    (as a variable's value), so a checkpoint restores into any t."""

    def __init__(self, shards, join, split, shape):
        super().__init__()
        self.shards = list(shards)
        self.join = join  # shards -> the whole tensor
        self.split = split  # the whole tensor -> shards
        self.shape = tuple(shape)

    def value(self):
        return self.join([tf.convert_to_tensor(s) for s in self.shards])

    def restore(self, whole):
        return tf.group([s.assign(p) for s, p in zip(self.shards, self.split(whole))])


@keras.saving.register_keras_serializable("tfdist")
class ShardedDense(keras.layers.Layer):
    """A Dense layer whose kernel (and, column-parallel, bias) is split over `devices`.

    `split="column"`: device r holds output units; with `groups=g` the units are g equal groups
    (q, k, v), or groups of the given widths (`groups=(q, kv, kv)`: grouped-query attention), and
    device r holds its slice of each. `split="row"`: device r holds input rows, and
    the bias is whole on devices[0]. Called like a Dense it computes the unsplit result;
    `column(r, x)` and `row(r, x)` are device r's part. Initialised exactly as the Dense it replaces
    (the whole kernel is drawn with the same initializer, then split).
    """

    def __init__(self, units, devices, split="column", groups=1, use_bias=True,
                 kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        if split not in ("column", "row"):
            raise ValueError(f"split must be 'column' or 'row', got {split!r}")
        self.units = units
        self.devices = list(devices)
        self.split = split
        self.groups = groups
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    @property
    def t(self):
        return len(self.devices)

    # -- the whole tensor <-> its shards --------------------------------------------------------
    @property
    def group_widths(self):
        """The widths of the column groups: `groups` given as widths, or `groups` equal ones."""
        if isinstance(self.groups, (list, tuple)):
            return [int(g) for g in self.groups]
        return [self.units // self.groups] * self.groups

    def split_whole(self, whole, is_kernel=True):
        """The t shards of a tensor shaped like the unsplit kernel (or bias)."""
        if self.split == "row":
            return tf.split(whole, self.t, axis=0) if is_kernel else [whole]
        groups = tf.split(whole, self.group_widths, axis=-1)
        parts = [tf.split(g, self.t, axis=-1) for g in groups]  # [group][shard]
        return [tf.concat([p[r] for p in parts], axis=-1) if len(parts) > 1 else parts[0][r]
                for r in range(self.t)]

    def join_shards(self, shards, is_kernel=True):
        if self.split == "row":
            return tf.concat(shards, axis=0) if is_kernel else shards[0]
        local = [w // self.t for w in self.group_widths]
        pieces = [tf.split(s, local, axis=-1) if len(local) > 1 else [s] for s in shards]
        return tf.concat([pieces[r][g] for g in range(len(local)) for r in range(self.t)],
                         axis=-1)

    def build(self, input_shape):
        n_in = int(input_shape[-1])
        whole = self.kernel_initializer((n_in, self.units), dtype=self.variable_dtype)
        self.kernels = []
        for r, (device, part) in enumerate(zip(self.devices, self.split_whole(whole))):
            with tf.device(device):
                self.kernels.append(self.add_weight(
                    name=f"kernel_{r}", shape=tuple(part.shape),
                    initializer=lambda shape, dtype, part=part: part))
        self.biases = []
        if self.use_bias:
            width = self.units // self.t if self.split == "column" else self.units
            for r in range(self.t if self.split == "column" else 1):
                with tf.device(self.devices[r]):
                    self.biases.append(self.add_weight(name=f"bias_{r}", shape=(width,),
                                                       initializer="zeros"))
        # one ZeRO owner for all of them (tfdist.parallel.zero)
        for shards in (self.kernels, self.biases):
            for v in shards:
                v.tfdist_shard_of = (id(self), id(shards))
        BUILT.add(self)

    def whole(self):
        """{"kernel": ..., "bias": ...} as the unsplit Dense's variables, for checkpoints."""
        n_in = self.kernels[0].shape[0] * (self.t if self.split == "row" else 1)
        out = {"kernel": _Whole(self.kernels, self.join_shards, self.split_whole,
                                (n_in, self.units))}
        if self.use_bias:
            out["bias"] = _Whole(self.biases, lambda s: self.join_shards(s, False),
                                 lambda w: self.split_whole(w, False), (self.units,))
        return out

    # -- compute ----------------------------------------------------------------------------------
    def _matmul(self, x, kernel):
        return ops.matmul(ops.cast(x, self.compute_dtype), ops.cast(kernel, self.compute_dtype))

    def _bias(self, r):
        return ops.cast(self.biases[r], self.compute_dtype)

    def column(self, r, x):
        """Device r's output units (its slice of each group)."""
        y = self._matmul(x, self.kernels[r])
        return y + self._bias(r) if self.use_bias else y

    def row(self, r, x):
        """Device r's partial output from its input rows (no bias: add `add_bias` after the sum)."""
        return self._matmul(x, self.kernels[r])

    def add_bias(self, y):
        return y + self._bias(0) if self.use_bias else y

    def call(self, x):
        """The unsplit result (the GPT called whole, e.g. to sample)."""
        kernel = self.join_shards(self.kernels)
        y = self._matmul(x, kernel)
        if self.use_bias:
            y = y + ops.cast(self.join_shards(self.biases, False), self.compute_dtype)
        return y

    def get_config(self):
        return {**super().get_config(), "units": self.units, "devices": self.devices,
                "split": self.split, "groups": self.groups, "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer)}


def _swap(parent, attr, split, devices, groups=1):
    dense = getattr(parent, attr)
    sharded = ShardedDense(dense.units, devices, split=split, groups=groups,
                           use_bias=dense.use_bias, kernel_initializer=dense.kernel_initializer,
                           name=dense.name, dtype=dense.dtype_policy)
    compat.replace_sublayer(parent, attr, sharded)  # the Dense it replaces is never built


def shard_blocks(gpt, block_devices, layout):
    """Replaces the Dense layers of each (unbuilt) block i with ShardedDense layers over
    `block_devices[i]`, as `layout` (`megatron_layout`) says, and makes the block's call
    `parallel_block` on them: the block is called as a layer still (`block(x, training=...)`),
    so what wraps a layer's call (ZeRO-3's gather, tfdist.parallel.zero.weights) wraps it too."""
    for block, devices in zip(gpt.blocks, block_devices):
        for parent, attr, path in ((block.attn, "c_attn", "attn/c_attn"),
                                   (block.attn, "c_proj", "attn/c_proj"),
                                   (block, "c_fc", "c_fc"),
                                   (block, "c_proj", "mlp_c_proj")):
            axes = layout[f"{block.name}/{path}/kernel"].axes
            split = "column" if axes == (None, AXIS) else "row"
            _swap(parent, attr, split, devices, groups=_groups(block, attr, parent))
        block.call = _parallel_call(block, devices)


def _groups(block, attr, parent):
    """How a column-parallel layer's units group: c_attn's queries, keys and values; a SwiGLU
    c_fc's gate and up halves (each device holds its slice of each group)."""
    if attr == "c_attn":
        return tuple(block.attn.qkv_widths)
    if parent is block and attr == "c_fc" and block.arch == "llama":
        return 2
    return 1


def _parallel_call(block, devices):
    def call(x, training=False):
        return parallel_block(block, x, training, devices)
    return call


def _sum(parts, device):
    with tf.device(device):
        return tf.add_n(parts) if len(parts) > 1 else parts[0]


def parallel_block(block, x, training, devices):
    """One GPT block, x + attn(ln_1(x)) then x + mlp(ln_2(x)), with its heads and hidden units
    split over `devices` (the residual stream and LayerNorms on devices[0]). Computes what
    `Block.call` computes (tests/test_tensor_parallel.py compares gradients). Under sequence
    parallelism `x` is a list of sequence chunks instead (`scatter_sequence`)."""
    with tf.name_scope(block.name):  # ops named <block>/tp<r>/...: tests find each shard's ops
        if isinstance(x, list):
            return _sequence_block(block, x, training, devices)
        return _parallel_block(block, x, training, devices)


def _parallel_block(block, x, training, devices):
    attn, home = block.attn, devices[0]
    heads, kv_heads = attn.n_head // len(devices), attn.n_kv_head // len(devices)
    with tf.device(home):
        h = block.ln_1(x)
    parts = []
    for r, device in enumerate(devices):
        with tf.device(device), tf.name_scope(f"tp{r}"):
            y = attn.attend_columns(attn.c_attn.column(r, h), heads, kv_heads, training)
            parts.append(attn.c_proj.row(r, y))
    with tf.device(home):
        x = x + attn.resid_dropout(attn.c_proj.add_bias(_sum(parts, home)), training=training)
        h = block.ln_2(x)
    parts = []
    for r, device in enumerate(devices):
        with tf.device(device), tf.name_scope(f"tp{r}"):
            parts.append(block.c_proj.row(r, block.activation(block.c_fc.column(r, h))))
    with tf.device(home):
        return x + block.mlp_dropout(block.c_proj.add_bias(_sum(parts, home)), training=training)


# -- sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.2) -------------
# Outside the two matmul pairs (the LayerNorms, the dropouts, the residual stream) each of the t
# devices holds 1/t of the sequence instead of one device holding all of it. Megatron's g and
# g-bar: an all-gather of the chunks before each column-parallel matmul, and a reduce-scatter of
# the row-parallel partial outputs after it, in place of the all-reduce (in one process: a concat
# onto each device, and each chunk's sum of the t partials' slices on its own device).

def scatter_sequence(x, devices):
    """(B, T, C) -> t chunks (B, T/t, C), chunk r on devices[r] (T divisible by t)."""
    t = len(devices)
    T = x.shape[1]
    chunks = []
    for r, device in enumerate(devices):
        with tf.device(device):
            chunks.append(x[:, r * T // t:(r + 1) * T // t])
    return chunks


def gather_sequence(chunks, device):
    """The chunks joined into (B, T, C) on `device`."""
    with tf.device(device):
        return ops.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0]


def _reduce_scatter(parts, devices):
    """Chunk r of the sum of the t partial outputs (B, T, C), summed on devices[r]."""
    t, T = len(devices), parts[0].shape[1]
    return [_sum([p[:, r * T // t:(r + 1) * T // t] for p in parts], device)
            for r, device in enumerate(devices)]


def _sequence_block(block, xs, training, devices):
    attn = block.attn
    heads, kv_heads = attn.n_head // len(devices), attn.n_kv_head // len(devices)

    def norm(layer, chunks):
        out = []
        for r, (device, chunk) in enumerate(zip(devices, chunks)):
            with tf.device(device), tf.name_scope(f"tp{r}"):
                out.append(layer(chunk))
        return out

    def add(chunks, summed, dense, dropout):
        out = []
        for r, (device, chunk, part) in enumerate(zip(devices, chunks, summed)):
            with tf.device(device), tf.name_scope(f"tp{r}"):
                out.append(chunk + dropout(dense.add_bias(part), training=training))
        return out

    hs = norm(block.ln_1, xs)
    parts = []
    for r, device in enumerate(devices):
        with tf.device(device), tf.name_scope(f"tp{r}"):
            qkv = attn.c_attn.column(r, gather_sequence(hs, device))
            y = attn.attend_columns(qkv, heads, kv_heads, training)
            parts.append(attn.c_proj.row(r, y))
    xs = add(xs, _reduce_scatter(parts, devices), attn.c_proj, attn.resid_dropout)
    hs = norm(block.ln_2, xs)
    parts = []
    for r, device in enumerate(devices):
        with tf.device(device), tf.name_scope(f"tp{r}"):
            h = gather_sequence(hs, device)
            parts.append(block.c_proj.row(r, block.activation(block.c_fc.column(r, h))))
    return add(xs, _reduce_scatter(parts, devices), block.c_proj, block.mlp_dropout)


def build_block(block, x, devices):
    """Creates a block's variables (each shard on its device), under the paths the unsplit
    block's would have (h_<i>/attn/c_attn/kernel_0, ...), by building and running it once."""
    C = block.n_embd
    with keras.name_scope(block.name):
        with keras.name_scope("attn"):
            block.attn.c_attn.build((None, C))
            block.attn.c_proj.build((None, C))
        block.c_fc.build((None, C))
        block.c_proj.build((None, block.ffn_hidden))
        y = parallel_block(block, x, False, devices)  # the LayerNorms, on devices[0]
    block.built = block.attn.built = True
    return y
