"""A decoder-only transformer in Keras 3, of GPT-2's kind or Llama's. No strategy-specific code
lives here.

`arch="gpt2"` (the default): token + learned position embeddings, pre-LayerNorm blocks of causal
multi-head self-attention and a GELU MLP, a final LayerNorm and an output head tied to the token
embedding; initialisation follows GPT-2 / nanoGPT.

`arch="llama"` (Touvron et al. 2023; Llama 3): no position embeddings but rotary ones on the
queries and keys (`tfdist.models.rope`, base `rope_theta`, Llama 3.1's frequency scaling
optional), RMSNorm, grouped-query attention (`n_kv_head` key/value heads shared by the
`n_head` query heads), a SwiGLU MLP `ffn_hidden` wide, and (unless `bias` or
`tie_embeddings` say otherwise) no biases and an output head of its own.

Both share one layout of variables, which tensor parallelism, pipelines, ZeRO and checkpoints
rely on: `h_<i>/attn/c_attn` (the queries', keys' and values' columns side by side),
`h_<i>/attn/c_proj`, `h_<i>/c_fc` (GELU's input; SwiGLU's gate and up columns side by side),
`h_<i>/mlp_c_proj`, the norms `h_<i>/ln_1`, `h_<i>/ln_2`, `ln_f`, the embedding `wte`, and
`wpe` (GPT-2) or `lm_head` (an untied head).

Example:

    >>> import numpy as np
    >>> from tfdist.models.gpt import GPT
    >>> model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    >>> tuple(model(np.zeros((1, 8), "int32")).shape)
    (1, 8, 256)
    >>> tokens = model.generate(np.array([[104, 105]]), max_new_tokens=5, top_k=10, seed=0)
    >>> tuple(tokens.shape)
    (1, 7)
    >>> llama = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32, arch="llama",
    ...             n_kv_head=2)
    >>> tuple(llama(np.zeros((1, 8), "int32")).shape)
    (1, 8, 256)
"""
import math

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfdist.models import rope
from tfdist.models.arithmetic import Transformer, default_ffn_hidden
from tfdist.models.fused import gelu, layer_norm, masked_softmax, rms_norm, swiglu

ARCHITECTURES = ("gpt2", "llama")


@keras.saving.register_keras_serializable("tfdist")
class LayerNorm(keras.layers.LayerNormalization):
    """Keras's LayerNormalization over the last axis (the same weights), computed in float32 also
    under mixed precision, one pass forward and one backward (`tfdist.models.fused.layer_norm`)."""

    def call(self, inputs):
        return ops.cast(layer_norm(inputs, self.gamma if self.scale else None,
                                   self.beta if self.center else None, self.epsilon),
                        self.compute_dtype)


@keras.saving.register_keras_serializable("tfdist")
class RMSNorm(keras.layers.RMSNormalization):
    """Keras's RMSNormalization over the last axis (its `scale` weight), computed in float32 also
    under mixed precision, as Llama's reference does (`tfdist.models.fused.rms_norm`)."""

    def call(self, inputs):
        return ops.cast(rms_norm(inputs, self.scale, self.epsilon), self.compute_dtype)


def _norm(arch, epsilon, bias, name):
    if arch == "llama":
        return RMSNorm(epsilon=epsilon, name=name)
    return LayerNorm(epsilon=epsilon, center=bias, name=name)


def _causal_bias(q_positions, k_positions):
    """(Tq, Tk) float32: 0 where the query at a position may see the key at a position (key <=
    query), -1e9 elsewhere; added to the attention scores (one pass, nothing to differentiate)."""
    later = ops.greater(k_positions[None, :], q_positions[:, None])
    return ops.cast(later, "float32") * -1e9


def _heads(t, n):
    """(B, T, n * hd) -> (B, n, T, hd)."""
    B, T = ops.shape(t)[0], ops.shape(t)[1]
    return ops.transpose(ops.reshape(t, (B, T, n, t.shape[-1] // n)), (0, 2, 1, 3))


def attend(q, k, v, q_positions, k_positions, dropout=None, training=False):
    """Causal attention of heads: q (B, H, Tq, hd), already scaled by 1/sqrt(hd); k, v (B, KV,
    Tk, hd), each key/value head shared by H / KV query heads (grouped-query attention; KV = H:
    multi-head). A query sees the keys at positions <= its own. Returns (B, Tq, H * hd). The
    softmax runs in float32 also under mixed precision."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # query head i reads key/value head i // groups
        k, v = ops.repeat(k, groups, axis=1), ops.repeat(v, groups, axis=1)
    att = masked_softmax(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))),
                         _causal_bias(q_positions, k_positions), v.dtype)
    if dropout is not None:
        att = dropout(att, training=training)
    y = ops.transpose(ops.matmul(att, v), (0, 2, 1, 3))
    return ops.reshape(y, (ops.shape(y)[0], ops.shape(y)[1], q.shape[1] * q.shape[3]))


def attention(q, k, v, n_head, dropout, training=False, n_kv_head=None, inv_freq=None,
              positions=None):
    """Causal attention of `n_head` query heads over `n_kv_head` key/value heads (default:
    n_head): q (B, T, n_head * hd), k, v (B, T, n_kv_head * hd) -> (B, T, n_head * hd).
    `dropout` (a Dropout layer) on the attention weights; `inv_freq` (`tfdist.models.rope`): the
    queries and keys rotated by their `positions` (default 0..T-1)."""
    hd = q.shape[-1] // n_head
    q = q * ops.cast(1.0 / math.sqrt(hd), q.dtype)  # scaled here: T/hd times fewer numbers
    q, k, v = _heads(q, n_head), _heads(k, n_kv_head or n_head), _heads(v, n_kv_head or n_head)
    if positions is None:
        positions = ops.arange(ops.shape(q)[2], dtype="int32")
    if inv_freq is not None:
        q, k = rope.rotate(q, positions, inv_freq), rope.rotate(k, positions, inv_freq)
    return attend(q, k, v, positions, positions, dropout, training)


def _dense(units, std, bias, name):
    return keras.layers.Dense(units, use_bias=bias, name=name,
                              kernel_initializer=keras.initializers.RandomNormal(stddev=std))


@keras.saving.register_keras_serializable("tfdist")
class CausalSelfAttention(keras.layers.Layer):
    """Self-attention where position t sees only positions <= t: `n_head` query heads over
    `n_kv_head` key/value heads (default n_head), rotary position embeddings when
    `rope_theta` is given."""

    def __init__(self, n_embd, n_head, n_layer, dropout=0.0, bias=True, n_kv_head=None,
                 rope_theta=None, rope_scaling=None, **kwargs):
        super().__init__(**kwargs)
        self.n_embd = n_embd
        self.n_head = n_head
        self.n_layer = n_layer
        self.dropout = dropout
        self.bias = bias
        self.n_kv_head = n_kv_head or n_head
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.inv_freq = (None if rope_theta is None else
                         rope.inverse_frequencies(n_embd // n_head, rope_theta, rope_scaling))
        self.c_attn = _dense(sum(self.qkv_widths), 0.02, bias, "c_attn")
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer).
        self.c_proj = _dense(n_embd, 0.02 / math.sqrt(2 * n_layer), bias, "c_proj")
        self.attn_dropout = keras.layers.Dropout(dropout)
        self.resid_dropout = keras.layers.Dropout(dropout)

    @property
    def qkv_widths(self):
        """The widths of the queries', keys' and values' columns in `c_attn`."""
        kv = self.n_embd // self.n_head * self.n_kv_head
        return (self.n_embd, kv, kv)

    def attend_columns(self, qkv, n_head, n_kv_head, training=False):
        """Attention over `c_attn`'s output for `n_head` query and `n_kv_head` key/value heads
        (all of them, or one tensor-parallel device's share: `tfdist.models.tensor_parallel`)."""
        hd = self.n_embd // self.n_head
        q, k, v = ops.split(qkv, [n_head * hd, (n_head + n_kv_head) * hd], axis=-1)
        return attention(q, k, v, n_head, self.attn_dropout, training, n_kv_head, self.inv_freq)

    def call(self, x, training=False):
        y = self.attend_columns(self.c_attn(x), self.n_head, self.n_kv_head, training)
        return self.resid_dropout(self.c_proj(y), training=training)

    def decode(self, x, cache, offset):
        """Inference over the key/value cache: x (B, T, C) at positions offset..offset+T-1;
        cache (k, v), each (B, n_kv_head, S, hd) holding positions 0..S-1 (those not yet
        written are masked: they lie after every query). Returns (y, the cache with x's keys
        and values written in)."""
        hd = self.n_embd // self.n_head
        q, k, v = ops.split(self.c_attn(x), [self.n_embd, self.n_embd + self.qkv_widths[1]],
                            axis=-1)
        q = _heads(q * ops.cast(1.0 / math.sqrt(hd), q.dtype), self.n_head)
        k, v = _heads(k, self.n_kv_head), _heads(v, self.n_kv_head)
        positions = offset + ops.arange(ops.shape(x)[1], dtype="int32")
        if self.inv_freq is not None:
            q, k = rope.rotate(q, positions, self.inv_freq), rope.rotate(k, positions,
                                                                          self.inv_freq)
        slots = ops.arange(cache[0].shape[2], dtype="int32")  # the cache's positions
        new = ops.logical_and(slots >= offset, slots < offset + ops.shape(x)[1])[:, None]
        index = ops.clip(slots - offset, 0, ops.shape(x)[1] - 1)
        cache = tuple(ops.where(new, ops.take(t, index, axis=2), c)
                      for t, c in zip((k, v), cache))
        y = attend(q, cache[0], cache[1], positions, slots)
        return self.c_proj(y), cache

    def get_config(self):
        return {**super().get_config(), "n_embd": self.n_embd, "n_head": self.n_head,
                "n_layer": self.n_layer, "dropout": self.dropout, "bias": self.bias,
                "n_kv_head": self.n_kv_head, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling}


@keras.saving.register_keras_serializable("tfdist")
class Block(keras.layers.Layer):
    """x + attn(norm(x)), then x + mlp(norm(x)); the MLP is GELU (gpt2) or SwiGLU (llama)."""

    def __init__(self, n_embd, n_head, n_layer, dropout=0.0, bias=True, arch="gpt2",
                 n_kv_head=None, ffn_hidden=None, rope_theta=10000.0, rope_scaling=None,
                 norm_eps=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.n_embd = n_embd
        self.n_head = n_head
        self.n_layer = n_layer
        self.dropout = dropout
        self.bias = bias
        self.arch = arch
        self.n_kv_head = n_kv_head or n_head
        self.ffn_hidden = ffn_hidden or default_ffn_hidden(arch, n_embd)
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.norm_eps = norm_eps
        llama = arch == "llama"
        self.ln_1 = _norm(arch, norm_eps, bias, "ln_1")
        self.attn = CausalSelfAttention(n_embd, n_head, n_layer, dropout, bias, self.n_kv_head,
                                        rope_theta if llama else None,
                                        rope_scaling if llama else None, name="attn")
        self.ln_2 = _norm(arch, norm_eps, bias, "ln_2")
        gates = 2 if llama else 1  # SwiGLU's gate and up columns, side by side
        self.c_fc = _dense(gates * self.ffn_hidden, 0.02, bias, "c_fc")
        self.c_proj = _dense(n_embd, 0.02 / math.sqrt(2 * n_layer), bias, "mlp_c_proj")
        self.mlp_dropout = keras.layers.Dropout(dropout)

    def activation(self, h):
        """The MLP's nonlinearity on `c_fc`'s output (or a tensor-parallel device's columns of
        it: each holds its share of the gate and of the up columns)."""
        return swiglu(h) if self.arch == "llama" else gelu(h)

    def call(self, x, training=False):
        x = x + self.attn(self.ln_1(x), training=training)
        h = self.activation(self.c_fc(self.ln_2(x)))
        return x + self.mlp_dropout(self.c_proj(h), training=training)

    def decode(self, x, cache, offset):
        """`call` for inference over the key/value cache (`CausalSelfAttention.decode`)."""
        y, cache = self.attn.decode(self.ln_1(x), cache, offset)
        x = x + y
        return x + self.c_proj(self.activation(self.c_fc(self.ln_2(x)))), cache

    def get_config(self):
        return {**super().get_config(), "n_embd": self.n_embd, "n_head": self.n_head,
                "n_layer": self.n_layer, "dropout": self.dropout, "bias": self.bias,
                "arch": self.arch, "n_kv_head": self.n_kv_head, "ffn_hidden": self.ffn_hidden,
                "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
                "norm_eps": self.norm_eps}


#: The `model` config keys GPT takes (tfdist/config.py).
MODEL_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias",
              "arch", "n_kv_head", "ffn_hidden", "rope_theta", "norm_eps", "tie_embeddings")


def rope_scaling_of(model_config):
    """Llama 3.1's rotary frequency scaling from the config's `model.rope_scaling_*` keys (None:
    off, factor 0)."""
    m = model_config
    if not m["rope_scaling_factor"]:
        return None
    return {"factor": float(m["rope_scaling_factor"]),
            "low_freq_factor": float(m["rope_low_freq_factor"]),
            "high_freq_factor": float(m["rope_high_freq_factor"]),
            "original_context": int(m["rope_original_context"])}


@keras.saving.register_keras_serializable("tfdist")
class GPT(keras.Model):
    """GPT language model: int token ids (B, T) -> logits (B, T, vocab_size). `arch` "gpt2" or
    "llama" (the module's docstring)."""

    def __init__(self, vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64,
                 dropout=0.0, bias=None, arch="gpt2", n_kv_head=None, ffn_hidden=None,
                 rope_theta=10000.0, rope_scaling=None, norm_eps=1e-5, tie_embeddings=None,
                 recompute=(), **kwargs):
        super().__init__(**kwargs)
        if arch not in ARCHITECTURES:
            raise ValueError(f"arch {arch!r}: one of {', '.join(ARCHITECTURES)}")
        # blocks whose forward runs again in the backward pass (`keras.remat`: their activations
        # are not kept), as a per-layer plan chooses them (tfdist.plan.layers)
        self.recompute = tuple(sorted({int(i) for i in recompute}))
        if any(not 0 <= i < n_layer for i in self.recompute):
            raise ValueError(f"recompute {list(self.recompute)}: block indices in [0, {n_layer})")
        # None: the architecture's (GPT-2: biases and a tied head; Llama: neither)
        bias = arch != "llama" if bias is None else bias
        tie_embeddings = arch != "llama" if tie_embeddings is None else tie_embeddings
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = dropout
        self.bias = bias
        self.arch = arch
        self.n_kv_head = n_kv_head or n_head
        self.ffn_hidden = ffn_hidden or default_ffn_hidden(arch, n_embd)
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.norm_eps = norm_eps
        self.tie_embeddings = tie_embeddings
        init = keras.initializers.RandomNormal(stddev=0.02)
        self.wte = keras.layers.Embedding(vocab_size, n_embd, embeddings_initializer=init,
                                          name="wte")
        self.wpe = None if arch == "llama" else keras.layers.Embedding(
            block_size, n_embd, embeddings_initializer=init, name="wpe")
        self.drop = keras.layers.Dropout(dropout)
        self.blocks = [Block(n_embd, n_head, n_layer, dropout, bias, arch, self.n_kv_head,
                             self.ffn_hidden, rope_theta, rope_scaling, norm_eps, name=f"h_{i}")
                       for i in range(n_layer)]
        self.ln_f = _norm(arch, norm_eps, bias, "ln_f")
        # an untied head: float32 logits also under mixed precision
        self.lm_head = None if tie_embeddings else keras.layers.Dense(
            vocab_size, use_bias=False, name="lm_head", dtype="float32", kernel_initializer=init)
        self._decoders = {}  # (shapes, sampling) -> compiled functions (`generate`)

    @classmethod
    def from_model_config(cls, model_config, **kwargs):
        """Builds from the `model` section of a tfdist config (its vocab_size resolved: 0 means
        "the tokenizer's", which the token store knows; `tfdist.train.model_vocab` sets it)."""
        if not model_config["vocab_size"]:
            raise ValueError("model.vocab_size is 0 (the tokenizer's): set it from the token store "
                             "first (tfdist.train.model_vocab) or give it")
        return cls(**{k: model_config[k] for k in MODEL_KEYS},
                   rope_scaling=rope_scaling_of(model_config), **kwargs)

    def build(self, input_shape=None):
        # Build every weight now so that checkpoints can be restored before the first step and
        # parameters can be counted without data. Two tokens are enough (no weight's shape depends
        # on the length; one would make Keras warn of a softmax over one position) and cost
        # nothing: GPT-2's whole block_size took 10 s of CPU here.
        if self.built:
            return
        self.built = True  # set first: the call below must not come back here
        self(ops.zeros((1, min(2, self.block_size)), dtype="int32"))

    def call(self, idx, training=False):
        x = self.embed(idx, training=training)
        for i, block in enumerate(self.blocks):
            if i in self.recompute:
                x = keras.remat(lambda x, block=block: block(x, training=training))(x)
            else:
                x = block(x, training=training)
        return self.head(x)

    # The three parts of `call`, also used by tfdist.models.pipeline to place them on devices.
    def embed(self, idx, training=False, offset=0):
        """Token ids (B, T) at positions offset.. -> embeddings (B, T, n_embd): the tokens' plus
        (GPT-2) their positions'."""
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(offset + ops.arange(ops.shape(idx)[1], dtype="int32"))[None]
        return self.drop(x, training=training)

    def head(self, x):
        """The final norm and the output head (tied: the token embedding's transpose): logits
        (B, T, vocab), in float32 also under mixed precision."""
        x = ops.cast(self.ln_f(x), "float32")
        if self.lm_head is not None:
            return self.lm_head(x)
        return ops.matmul(x, ops.transpose(ops.cast(self.wte.embeddings, "float32")))

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "block_size": self.block_size, "n_layer": self.n_layer, "n_head": self.n_head,
                "n_embd": self.n_embd, "dropout": self.dropout, "bias": self.bias,
                "arch": self.arch, "n_kv_head": self.n_kv_head, "ffn_hidden": self.ffn_hidden,
                "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
                "norm_eps": self.norm_eps, "tie_embeddings": self.tie_embeddings,
                "recompute": list(self.recompute)}

    @property
    def arch_sizes(self):
        """This GPT's sizes for tfdist.models.arithmetic (dropout masks are kept when dropout >
        0)."""
        llama = self.arch == "llama"
        return Transformer(n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
                           vocab_size=self.vocab_size, seq_len=self.block_size, bias=self.bias,
                           dropout=self.dropout > 0, n_kv_head=self.n_kv_head,
                           ffn=self.ffn_hidden, gated_mlp=llama,
                           tied_embeddings=self.tie_embeddings, learned_positions=not llama,
                           rms_norm=llama)

    def num_params(self, non_embedding=False):
        """Parameter count (tfdist.models.arithmetic: Keras's count_params() of the built model,
        tests/test_arithmetic.py); the tied head is counted once. non_embedding drops position
        embeddings."""
        a = self.arch_sizes
        return a.non_embedding_params() if non_embedding else a.params()

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token (forward + backward), nanoGPT / PaLM: 6N + 12 L H Q T."""
        return self.arch_sizes.flops_per_token(seq_len)

    # -- sampling ----------------------------------------------------------------------------------
    def decode(self, idx, caches, offset):
        """Logits (B, T, vocab) of tokens `idx` (B, T) at positions offset..offset+T-1, given the
        key/value caches of the positions before (one (k, v) per block, each (B, n_kv_head, S,
        hd)); returns them with the caches updated."""
        x = self.embed(idx, offset=offset)
        out = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block.decode(x, cache, offset)
            out.append(cache)
        return self.head(x), out

    def empty_caches(self, batch, length):
        """Zeros for `decode`: a (k, v) per block of `length` positions."""
        shape = (batch, self.n_kv_head, length, self.n_embd // self.n_head)
        return [(tf.zeros(shape, self.compute_dtype), tf.zeros(shape, self.compute_dtype))
                for _ in self.blocks]

    def _compiled(self, batch, prompt, length, temperature, top_k, vocab_size):
        """The tf.functions `generate` runs, made once per shape and sampling setting: the
        prompt's pass (prefill) and one token's step, each returning a sampled next token."""
        key = (batch, prompt, length, temperature, top_k, vocab_size)
        if key in self._decoders:
            return self._decoders[key]

        def sample(logits, seed):
            logits = logits[:, -1, :vocab_size] / temperature  # the ids keep their values
            if top_k:
                kth = tf.math.top_k(logits, k=min(top_k, logits.shape[-1])).values[:, -1:]
                logits = tf.where(logits < kth, tf.fill(tf.shape(logits), -np.inf), logits)
            return tf.random.stateless_categorical(logits, 1, seed=seed, dtype=tf.int32)

        @tf.function(jit_compile=False, autograph=False)
        def prefill(idx, seed):
            logits, caches = self.decode(idx, self.empty_caches(batch, length), 0)
            return sample(logits, seed), caches

        @tf.function(jit_compile=False, autograph=False)
        def step(token, caches, offset, seed):
            logits, caches = self.decode(token, caches, offset)
            return sample(logits, seed), caches

        self._decoders[key] = prefill, step
        return prefill, step

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, seed=None,
                 vocab_size=None):
        """Samples `max_new_tokens` after the prompt `idx` (int array (B, T) or (T,)), over a
        key/value cache: the prompt is run once, then each new token alone.

        temperature scales the logits; top_k keeps only the k most likely tokens (None/0: all;
        1: greedy); vocab_size, if the embedding is padded beyond the tokenizer's vocabulary,
        keeps the ids below it. The prompt and its continuation are kept within block_size: a
        longer prompt is cut to its last block_size tokens, and when the cache is full it starts
        again from the last half of the context. Returns a numpy int32 array (B, T +
        max_new_tokens).
        """
        idx = np.asarray(idx, dtype="int32")
        if idx.ndim == 1:
            idx = idx[None]
        if idx.shape[1] == 0:
            raise ValueError("generate() needs a prompt of at least one token")
        vocab = min(vocab_size or self.vocab_size, self.vocab_size)
        rng = tf.random.Generator.from_seed(0 if seed is None else seed)
        B, out = idx.shape[0], [idx]
        length = min(self.block_size, idx.shape[1] + max_new_tokens)
        context = idx[:, -length:] if idx.shape[1] >= length else idx
        made = 0
        while made < max_new_tokens:
            prefill, step = self._compiled(B, context.shape[1], length, float(temperature),
                                           int(top_k or 0), vocab)
            token, caches = prefill(tf.constant(context), rng.make_seeds(1)[:, 0])
            offset = context.shape[1]
            while True:
                out.append(token.numpy())
                made += 1
                if made == max_new_tokens or offset == length:
                    break
                token, caches = step(token, caches, tf.constant(offset, tf.int32),
                                     rng.make_seeds(1)[:, 0])
                offset += 1
            # the cache is full: again from the last half of the context
            context = np.concatenate(out, axis=1)[:, -max(1, length // 2):]
        return np.concatenate(out, axis=1)


def loss_fn():
    """Next-token cross entropy (nats per token) on logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def layout_map(device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"):
    """A `keras.distribution.LayoutMap` of the GPT's weights, as keras-hub's backbones give one
    (`LlamaBackbone.get_layout_map`), for `keras.distribution.ModelParallel` on TensorFlow through
    `tfdist.parallel.mesh` (docs/parallelism.md), over the mesh axis `model_parallel_dim_name`:
    the token embedding by vocabulary rows, an untied head by vocabulary columns, and each
    block's first kernels, the attention's q|k|v (`c_attn`) and the MLP's (`c_fc`), by their
    input rows (each device holds 1/model of them and computes its part of their matmuls, summed
    by an all-reduce). The output projections stay whole, and Megatron's column split is not
    used, for DTensor's sake (TF 2.21): the model splits q|k|v and SwiGLU's gate|up by columns,
    which DTensor cannot do over a sharded dimension ("Spliting over sharded dimension is not
    supported"), and a row-sharded output projection fed a whole activation fails its SPMD
    expansion ("op output inconsistent with the provided layout"). The architecture "gpt2" does
    not run on a mesh at all (docs/parallelism.md); tfdist's own tensor parallelism
    (`tensor.parallel`) splits both architectures Megatron's way. The data axis
    (`data_parallel_dim_name`) shards the batch, not the weights. (A per-layer plan's map, which
    splits only some layers: `tfdist.plan.layers.to_layout_map`.)

        >>> import keras
        >>> mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), ["cpu:0"])
        >>> layout_map(mesh)["gpt/h_0/attn/c_attn/kernel"].axes  # (a weight's path)
        ('model', None)
    """
    if model_parallel_dim_name not in device_mesh.axis_names:
        raise ValueError(f"{model_parallel_dim_name!r} is not an axis of the DeviceMesh "
                         f"{device_mesh.axis_names}")
    del data_parallel_dim_name  # (the batch's axis: the data's layout, not a weight's)
    model = model_parallel_dim_name
    layouts = keras.distribution.LayoutMap(device_mesh)
    layouts[r".*wte/embeddings"] = (model, None)  # (Keras matches a key to a whole path)
    layouts[r".*attn/c_attn/kernel"] = (model, None)
    layouts[r".*/c_fc/kernel"] = (model, None)
    layouts[r".*lm_head/kernel"] = (None, model)
    return layouts
