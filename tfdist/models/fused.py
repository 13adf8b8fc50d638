"""The GPT's elementwise parts with fewer passes over their tensors, forward and backward.

On a CPU every elementwise op reads and writes its whole tensor, and TF's autodiff of the textbook
formulas of GELU, LayerNorm and the attention's masked softmax makes a dozen such passes each: in
a profile of gpt_mini (tools/bench/profile_step.py) they took about a third of the step's op time
beside the matmuls. Here each has its gradient written out, and GELU, the widest (4 x n_embd),
is one fused loop each way:

* `gelu`: on TensorFlow with a fully known shape (a training step's), its forward and backward
  are each an XLA-compiled function (`jit_compile=True`): 10.8 ms against 26.3 for gpt_mini's
  4096 x 1536 forward and backward here. Only GELU is compiled; the matmuls around it stay TF's
  oneDNN kernels (XLA's CPU matmuls do not use AMX, so a whole-model `jit_compile` is slower in
  bfloat16). Elsewhere (another Keras backend; an unknown dimension, as in `GPT.generate`, where
  XLA would compile once per length) the same function in `keras.ops`;
* `layer_norm` and `masked_softmax`: `keras.ops`. XLA's fused versions measured slower here
  (LayerNorm 4096 x 384: 5.9 ms against 4.9; softmax 16 x 6 x 256 x 256: 21.7 against 15.4):
  its CPU reductions are slower than TF's kernels.

Each computes in float32 also for a bfloat16 or float16 input, and returns the input's dtype.

Example:

    >>> import numpy as np
    >>> from tfdist.models import fused
    >>> round(float(fused.gelu(np.float32([1.0]))[0]), 4)
    0.8412
    >>> y = fused.layer_norm(np.float32([[1.0, 2.0, 3.0]]), np.ones(3, "float32"), None, 1e-5)
    >>> [round(float(v), 3) for v in np.asarray(y)[0]]
    [-1.225, 0.0, 1.225]
"""
import math

import keras
import tensorflow as tf
from keras import ops

_K1 = 2 * math.sqrt(2 / math.pi)  # GELU's tanh approximation: 0.5 (1 + tanh(u)) = sigmoid(2 u)
_K2 = _K1 * 0.044715


_XLA = {"on": True}  # off: no XLA-compiled function here (`use_xla`)


def use_xla(on):
    """Whether GELU may take its XLA-compiled path at all: off where no XLA-compiled function can
    run, as on a DTensor mesh (`tfdist.parallel.mesh` turns it off: in TF 2.21 such a function in
    a mesh's step fails with an undecodable error)."""
    _XLA["on"] = bool(on)


def _xla(x):
    """Whether `x` takes GELU's XLA-fused path (see the module's docstring)."""
    return (_XLA["on"] and keras.backend.backend() == "tensorflow"
            and x.shape.is_fully_defined())


def _jit(fn):
    return tf.function(fn, jit_compile=True, autograph=False)


# --- GELU: x * sigmoid(x (k1 + k2 x^2)), GPT-2's tanh approximation --------------------------

@_jit
def _gelu_forward(x):
    x32 = tf.cast(x, tf.float32)
    return tf.cast(x32 * tf.sigmoid(x32 * (_K1 + _K2 * tf.square(x32))), x.dtype)


@_jit
def _gelu_backward(x, dy):
    x32, dy32 = tf.cast(x, tf.float32), tf.cast(dy, tf.float32)
    t = tf.square(x32)
    s = tf.sigmoid(x32 * (_K1 + _K2 * t))  # recomputed: only x is kept for the backward
    return tf.cast(dy32 * s * (1 + x32 * (1 - s) * (_K1 + 3 * _K2 * t)), x.dtype)


@tf.custom_gradient
def _gelu_xla(x):
    return _gelu_forward(x), lambda dy: _gelu_backward(x, dy)


@ops.custom_gradient
def _gelu_ops(x):
    t = ops.square(x)
    s = ops.sigmoid(x * (_K1 + _K2 * t))

    def grad(*args, upstream=None):
        dy = args[0] if upstream is None else upstream
        return dy * s * (1 + x * (1 - s) * (_K1 + 3 * _K2 * t))
    return x * s, grad


def gelu(x):
    """GELU, GPT-2's tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = ops.convert_to_tensor(x)
    if _xla(x):
        return _gelu_xla(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    return ops.cast(_gelu_ops(ops.cast(x, "float32")), dtype)


# --- LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * gamma + beta ---------------

def _normalize(x, epsilon):
    """(x - mean) / sqrt(var + epsilon) over the last axis (float32), its gradient written out."""
    @ops.custom_gradient
    def normalize(x):
        xc = x - ops.mean(x, axis=-1, keepdims=True)
        rstd = ops.rsqrt(ops.mean(ops.square(xc), axis=-1, keepdims=True) + epsilon)
        xhat = xc * rstd

        def grad(*args, upstream=None):
            dy = args[0] if upstream is None else upstream
            return rstd * (dy - ops.mean(dy, axis=-1, keepdims=True)
                           - xhat * ops.mean(dy * xhat, axis=-1, keepdims=True))
        return xhat, grad
    return normalize(x)


def layer_norm(x, gamma, beta, epsilon):
    """LayerNorm of `x` over its last axis, computed in float32; `gamma`, `beta` (last axis's
    size) or None."""
    x = ops.convert_to_tensor(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    y = _normalize(ops.cast(x, "float32"), epsilon)
    if gamma is not None:
        y = y * ops.cast(gamma, "float32")
    if beta is not None:
        y = y + ops.cast(beta, "float32")
    return ops.cast(y, dtype)


# --- the attention's masked softmax: softmax(scores + bias) over the last axis ---------------

def masked_softmax(scores, bias, dtype):
    """softmax(scores + bias) over the last axis in float32, returned as `dtype`; `bias` (float32,
    broadcast to `scores`) holds no gradient: a mask."""
    return ops.cast(ops.softmax(ops.cast(scores, "float32") + bias, axis=-1), dtype)


# --- Llama's parts: RMSNorm and the SwiGLU MLP's gate ----------------------------------------

def rms_norm(x, scale, epsilon):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis (Zhang & Sennrich 2019), computed in
    float32 as Llama's reference does, returned in x's dtype."""
    x = ops.convert_to_tensor(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    x32 = ops.cast(x, "float32")
    y = x32 * ops.rsqrt(ops.mean(ops.square(x32), axis=-1, keepdims=True) + epsilon)
    return ops.cast(y * ops.cast(scale, "float32"), dtype)


def swiglu(x):
    """SwiGLU's gate (Shazeer 2020): x is [gate | up] along the last axis (its two halves);
    returns silu(gate) * up, half as wide."""
    gate, up = ops.split(x, 2, axis=-1)
    return ops.silu(gate) * up
