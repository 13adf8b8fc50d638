"""Rotary position embeddings (RoPE; Su et al. 2021, arXiv:2104.09864), as Llama uses them.

Each head's query and key vectors are rotated by an angle proportional to their position: the
pair of dimensions (i, i + d/2) of a head of width d turns by `position * theta**(-2i/d)`. A
query at position m and a key at position n then score `q . k` as a function of m - n alone.
The pairs are (i, i + d/2), Hugging Face's "rotate half" layout that its Llama checkpoints are
stored in (Meta's original code pairs (2i, 2i + 1); the checkpoints' converter permutes the
query and key rows between the two).

Llama 3.1's frequency scaling (`scaling`: factor, low_freq_factor, high_freq_factor,
original_context) stretches the low frequencies by `factor`, leaves the high ones, and blends
between (Meta's `apply_scaling`; transformers' `rope_type: "llama3"`).

Example:

    >>> import numpy as np
    >>> from tfdist.models import rope
    >>> inv = rope.inverse_frequencies(4, theta=10000.0)
    >>> [round(float(f), 6) for f in inv]
    [1.0, 0.01]
    >>> x = np.ones((1, 1, 2, 4), "float32")  # (batch, heads, positions, head width)
    >>> y = np.asarray(rope.rotate(x, np.arange(2), inv))
    >>> [round(float(v), 2) for v in y[0, 0, 1]]  # position 1: cos 1 - sin 1, ..., sin 1 + cos 1
    [-0.3, 0.99, 1.38, 1.01]
"""
import math

import numpy as np
from keras import ops


def inverse_frequencies(head_dim, theta=10000.0, scaling=None):
    """(head_dim / 2,) float32: theta**(-2i/head_dim), scaled as Llama 3.1 scales them when
    `scaling` (a dict: factor, low_freq_factor, high_freq_factor, original_context) is given."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head width, got {head_dim}")
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype="float64") / head_dim)
    if scaling:
        inv = _llama3_scaling(inv, **scaling)
    return inv.astype("float32")


def _llama3_scaling(inv, factor, low_freq_factor, high_freq_factor, original_context):
    """Meta's Llama 3.1 `apply_scaling`: wavelengths longer than original_context /
    low_freq_factor are stretched `factor` times, those shorter than original_context /
    high_freq_factor kept, and those between blended linearly in 1 / wavelength."""
    wavelength = 2 * math.pi / inv
    low, high = original_context / low_freq_factor, original_context / high_freq_factor
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor
                                                                  - low_freq_factor)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return np.where(wavelength < high, inv, np.where(wavelength > low, inv / factor, blended))


def rotate(x, positions, inv_freq):
    """x (B, H, T, d) rotated by `positions` (T,) int: each pair (i, i + d/2) turned by
    positions * inv_freq[i]. Computed in float32, returned in x's dtype."""
    dtype = x.dtype
    angles = ops.cast(positions, "float32")[:, None] * ops.convert_to_tensor(inv_freq)[None, :]
    cos = ops.concatenate([ops.cos(angles)] * 2, axis=-1)  # (T, d)
    sin = ops.concatenate([ops.sin(angles)] * 2, axis=-1)
    x32 = ops.cast(x, "float32")
    first, second = ops.split(x32, 2, axis=-1)
    rotated = ops.concatenate([-second, first], axis=-1)  # "rotate half"
    return ops.cast(x32 * cos + rotated * sin, dtype)
