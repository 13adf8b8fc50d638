"""A decoder-only transformer (GPT-2 shape) in Keras 3. No strategy-specific code lives here.

Token + position embeddings, pre-LayerNorm blocks of causal self-attention and MLP, a final
LayerNorm and an output head tied to the token embedding. Initialisation follows GPT-2 / nanoGPT.

Example:

    >>> import numpy as np
    >>> from tfdist.models.gpt import GPT
    >>> model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    >>> tuple(model(np.zeros((1, 8), "int32")).shape)
    (1, 8, 256)
    >>> tokens = model.generate(np.array([[104, 105]]), max_new_tokens=5, top_k=10, seed=0)
    >>> tuple(tokens.shape)
    (1, 7)
"""
import math

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfdist.models.arithmetic import Transformer
from tfdist.models.fused import gelu, layer_norm, masked_softmax


@keras.saving.register_keras_serializable("tfdist")
class LayerNorm(keras.layers.LayerNormalization):
    """Keras's LayerNormalization over the last axis (the same weights), computed in float32 also
    under mixed precision, one pass forward and one backward (`tfdist.models.fused.layer_norm`)."""

    def call(self, inputs):
        return ops.cast(layer_norm(inputs, self.gamma if self.scale else None,
                                   self.beta if self.center else None, self.epsilon),
                        self.compute_dtype)


def _causal_bias(T):
    """(T, T) float32: 0 where position t may see position s (s <= t), -1e9 above the diagonal;
    added to the attention scores (one pass, and nothing to differentiate)."""
    return ops.triu(ops.full((T, T), -1e9, dtype="float32"), k=1)


def attention(q, k, v, n_head, dropout, training=False):
    """Causal attention of `n_head` heads: q, k, v (B, T, n_head * hd) -> (B, T, n_head * hd);
    `dropout` (a Dropout layer) on the attention weights. The softmax runs in float32 also under
    mixed precision."""
    B, T, C = ops.shape(q)[0], ops.shape(q)[1], q.shape[-1]
    hd = C // n_head
    q = q * ops.cast(1.0 / math.sqrt(hd), q.dtype)  # scaled here: T/hd times fewer numbers
    # (B, T, C) -> (B, H, T, hd)
    q, k, v = (ops.transpose(ops.reshape(t, (B, T, n_head, hd)), (0, 2, 1, 3)) for t in (q, k, v))
    att = masked_softmax(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))), _causal_bias(T), v.dtype)
    att = dropout(att, training=training)
    return ops.reshape(ops.transpose(ops.matmul(att, v), (0, 2, 1, 3)), (B, T, C))


def _dense(units, std, bias, name):
    return keras.layers.Dense(units, use_bias=bias, name=name,
                              kernel_initializer=keras.initializers.RandomNormal(stddev=std))


@keras.saving.register_keras_serializable("tfdist")
class CausalSelfAttention(keras.layers.Layer):
    """Multi-head self-attention where position t sees only positions <= t."""

    def __init__(self, n_embd, n_head, n_layer, dropout=0.0, bias=True, **kwargs):
        super().__init__(**kwargs)
        self.n_embd = n_embd
        self.n_head = n_head
        self.n_layer = n_layer
        self.dropout = dropout
        self.bias = bias
        self.c_attn = _dense(3 * n_embd, 0.02, bias, "c_attn")
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer).
        self.c_proj = _dense(n_embd, 0.02 / math.sqrt(2 * n_layer), bias, "c_proj")
        self.attn_dropout = keras.layers.Dropout(dropout)
        self.resid_dropout = keras.layers.Dropout(dropout)

    def call(self, x, training=False):
        q, k, v = ops.split(self.c_attn(x), 3, axis=-1)
        y = attention(q, k, v, self.n_head, self.attn_dropout, training)
        return self.resid_dropout(self.c_proj(y), training=training)

    def get_config(self):
        return {**super().get_config(), "n_embd": self.n_embd, "n_head": self.n_head,
                "n_layer": self.n_layer, "dropout": self.dropout, "bias": self.bias}


@keras.saving.register_keras_serializable("tfdist")
class Block(keras.layers.Layer):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd, n_head, n_layer, dropout=0.0, bias=True, **kwargs):
        super().__init__(**kwargs)
        self.n_embd = n_embd
        self.n_head = n_head
        self.n_layer = n_layer
        self.dropout = dropout
        self.bias = bias
        self.ln_1 = LayerNorm(epsilon=1e-5, center=bias, name="ln_1")
        self.attn = CausalSelfAttention(n_embd, n_head, n_layer, dropout, bias, name="attn")
        self.ln_2 = LayerNorm(epsilon=1e-5, center=bias, name="ln_2")
        self.c_fc = _dense(4 * n_embd, 0.02, bias, "c_fc")
        self.c_proj = _dense(n_embd, 0.02 / math.sqrt(2 * n_layer), bias, "mlp_c_proj")
        self.mlp_dropout = keras.layers.Dropout(dropout)

    def call(self, x, training=False):
        x = x + self.attn(self.ln_1(x), training=training)
        h = gelu(self.c_fc(self.ln_2(x)))
        return x + self.mlp_dropout(self.c_proj(h), training=training)

    def get_config(self):
        return {**super().get_config(), "n_embd": self.n_embd, "n_head": self.n_head,
                "n_layer": self.n_layer, "dropout": self.dropout, "bias": self.bias}


@keras.saving.register_keras_serializable("tfdist")
class GPT(keras.Model):
    """GPT language model: int token ids (B, T) -> logits (B, T, vocab_size)."""

    def __init__(self, vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64,
                 dropout=0.0, bias=True, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = dropout
        self.bias = bias
        init = keras.initializers.RandomNormal(stddev=0.02)
        self.wte = keras.layers.Embedding(vocab_size, n_embd, embeddings_initializer=init,
                                          name="wte")
        self.wpe = keras.layers.Embedding(block_size, n_embd, embeddings_initializer=init,
                                          name="wpe")
        self.drop = keras.layers.Dropout(dropout)
        self.blocks = [Block(n_embd, n_head, n_layer, dropout, bias, name=f"h_{i}")
                       for i in range(n_layer)]
        self.ln_f = LayerNorm(epsilon=1e-5, center=bias, name="ln_f")

    @classmethod
    def from_model_config(cls, model_config, **kwargs):
        """Builds from the `model` section of a tfdist config (its vocab_size resolved: 0 means
        "the tokenizer's", which the token store knows; `tfdist.train.model_vocab` sets it)."""
        if not model_config["vocab_size"]:
            raise ValueError("model.vocab_size is 0 (the tokenizer's): set it from the token store "
                             "first (tfdist.train.model_vocab) or give it")
        keys = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias")
        return cls(**{k: model_config[k] for k in keys}, **kwargs)

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
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(x)

    # The three parts of `call`, also used by tfdist.models.pipeline to place them on devices.
    def embed(self, idx, training=False):
        """Token ids (B, T) -> token + position embeddings (B, T, n_embd)."""
        pos = ops.arange(ops.shape(idx)[1], dtype="int32")
        return self.drop(self.wte(idx) + self.wpe(pos)[None], training=training)

    def head(self, x):
        """Final LayerNorm and the output head tied to the token embedding: logits (B, T, vocab),
        in float32 also under mixed precision."""
        x = self.ln_f(x)
        return ops.matmul(ops.cast(x, "float32"),
                          ops.transpose(ops.cast(self.wte.embeddings, "float32")))

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "block_size": self.block_size, "n_layer": self.n_layer, "n_head": self.n_head,
                "n_embd": self.n_embd, "dropout": self.dropout, "bias": self.bias}

    @property
    def arch(self):
        """This GPT's sizes for tfdist.models.arithmetic (GELU MLP, multi-head attention, tied
        head, learned positions; dropout masks are kept when dropout > 0)."""
        return Transformer(n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
                           vocab_size=self.vocab_size, seq_len=self.block_size, bias=self.bias,
                           dropout=self.dropout > 0)

    def num_params(self, non_embedding=False):
        """Parameter count (tfdist.models.arithmetic: Keras's count_params() of the built model,
        tests/test_arithmetic.py); the tied head is counted once. non_embedding drops position
        embeddings."""
        return self.arch.non_embedding_params() if non_embedding else self.arch.params()

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token (forward + backward), nanoGPT / PaLM: 6N + 12 L H Q T."""
        return self.arch.flops_per_token(seq_len)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, seed=None,
                 vocab_size=None):
        """Samples `max_new_tokens` after the prompt `idx` (int array (B, T) or (T,)).

        temperature scales the logits; top_k keeps only the k most likely tokens (None/0: all);
        vocab_size, if the embedding is padded beyond the tokenizer's vocabulary, keeps the ids
        below it. Returns a numpy int32 array (B, T + max_new_tokens).
        """
        idx = np.asarray(idx, dtype="int32")
        if idx.ndim == 1:
            idx = idx[None]
        if idx.shape[1] == 0:
            raise ValueError("generate() needs a prompt of at least one token")
        rng = tf.random.Generator.from_seed(0 if seed is None else seed)

        @tf.function(reduce_retracing=True)
        def next_logits(ctx):
            return self(ctx, training=False)[:, -1, :]

        for _ in range(max_new_tokens):
            ctx = idx[:, -self.block_size:]
            logits = next_logits(tf.constant(ctx)) / temperature
            if vocab_size and vocab_size < logits.shape[-1]:
                logits = logits[:, :vocab_size]  # the ids keep their values
            if top_k:
                kth = tf.math.top_k(logits, k=min(top_k, logits.shape[-1])).values[:, -1:]
                logits = tf.where(logits < kth, tf.fill(tf.shape(logits), -np.inf), logits)
            nxt = tf.random.stateless_categorical(logits, 1, seed=rng.make_seeds(1)[:, 0],
                                                  dtype=tf.int32)
            idx = np.concatenate([idx, nxt.numpy()], axis=1)
        return idx


def loss_fn():
    """Next-token cross entropy (nats per token) on logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
