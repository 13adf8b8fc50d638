"""The Llama architecture's parts, each against its textbook computation written out here in
numpy or TF (rotary embeddings and Llama 3.1's frequency scaling, RMSNorm, the SwiGLU MLP,
grouped-query attention), each check shown to catch a wrong variant by running the same comparison
on it; and sampling over the key/value cache (`GPT.decode`, `GPT.generate`) for both
architectures: the full forward pass's logits, greedy decoding, a context beyond block_size, one
trace per shape, and a Llama model through a .keras file.

Comparisons are in float32 with a tolerance relative to the reference's largest magnitude
(`_close`), never bitwise: oneDNN takes other paths on other x86-64 CPUs."""
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.models import fused, gpt, rope
from tfdist.models.gpt import GPT

TOL = 1e-5  # float32, relative to the reference's largest magnitude
WRONG = 1e-2  # what a wrong variant is off by at least


def _close(a, b):
    """The largest difference of each pair, relative to the reference's (b's) largest
    magnitude."""
    out = []
    for p, q in zip(a, b):
        p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
        out.append(float(np.max(np.abs(p - q)) / (np.max(np.abs(q)) + 1e-12)))
    return out


def _normal(shape, seed, scale=1.0, offset=0.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale + offset).astype("float32")


# -- rotary embeddings -------------------------------------------------------------------------

def _textbook_rope(x, positions, theta):
    """x (..., T, d) with each pair (x_i, x_{i+d/2}) read as the complex number x_i + i x_{i+d/2}
    and multiplied by exp(i * position * theta^(-2i/d)). The angle is a float32 product, as in
    Meta's and Hugging Face's code (its rounding grows with the position); the rest float64."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    inv = (1.0 / theta ** (np.arange(d // 2) * 2.0 / d)).astype("float32")
    angles = (np.asarray(positions, "float32")[:, None] * inv[None, :]).astype(np.float64)
    z = (x[..., :d // 2] + 1j * x[..., d // 2:]) * np.exp(1j * angles)
    return np.concatenate([z.real, z.imag], axis=-1)


def _interleaved_rope(x, positions, inv_freq):
    """The wrong layout for Hugging Face's checkpoints: Meta's original pairs (x_{2i},
    x_{2i+1})."""
    x = np.asarray(x, np.float64)
    angles = (np.asarray(positions, "float32")[:, None] * inv_freq[None, :]).astype(np.float64)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angles)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def _squared_rope(x, positions, inv_freq):
    """Not a rotary embedding: the angle grows with the square of the position."""
    return rope.rotate(x, np.asarray(positions) ** 2, inv_freq)


ROPE_POSITIONS = np.array([0, 1, 2, 3, 5, 8, 13, 100, 1000, 4095])


def _rope_error(rotate, theta=10000.0):
    """`rotate`'s (x, positions, inv_freq) largest difference from the textbook rotation."""
    x = _normal((2, 3, len(ROPE_POSITIONS), 16), 0)
    inv = rope.inverse_frequencies(16, theta)
    return _close([rotate(x, ROPE_POSITIONS, inv)], [_textbook_rope(x, ROPE_POSITIONS, theta)])[0]


def _relative_position_error(rotate):
    """How far <rotate(q, m), rotate(k, n)> is from depending on m - n alone: the largest change
    of the score when both positions are shifted by s, relative to |q| |k|."""
    d = 16
    inv = rope.inverse_frequencies(d, 10000.0)
    q, k = _normal((1, 1, 1, d), 1), _normal((1, 1, 1, d), 2)
    norm = float(np.linalg.norm(q) * np.linalg.norm(k))

    def score(m, n):
        qm = np.asarray(rotate(q, np.array([m]), inv), np.float64)
        kn = np.asarray(rotate(k, np.array([n]), inv), np.float64)
        return float(np.sum(qm * kn))
    worst = 0.0
    for m, n in [(0, 0), (3, 1), (1, 3), (7, 2), (9, 9), (15, 0)]:
        for s in (1, 2, 5, 20):
            worst = max(worst, abs(score(m + s, n + s) - score(m, n)) / norm)
    return worst


def test_rope_rotates_each_half_split_pair_by_position_times_theta_power():
    """Each pair (x_i, x_{i+d/2}) turned by position * theta^(-2i/d) (complex multiplication),
    for positions up to 4095; the frequencies are theta^(-2i/d)."""
    assert _rope_error(rope.rotate) < TOL
    assert _rope_error(rope.rotate, theta=500000.0) < TOL
    np.testing.assert_allclose(rope.inverse_frequencies(16, 10000.0),
                               10000.0 ** (-np.arange(8) * 2 / 16), rtol=1e-6)


def test_rope_scores_depend_only_on_the_relative_position():
    """<rope(q, m), rope(k, n)> is unchanged when m and n are shifted together (within float32
    rounding of angles up to 35)."""
    assert _relative_position_error(rope.rotate) < TOL


def test_the_rope_check_finds_interleaved_pairs_and_a_non_rotary_angle():
    """The companion: Meta's interleaved pairs (2i, 2i+1), a rotary embedding too and so
    relative, fail the layout check; an angle growing with position^2 fails the relative one."""
    assert _rope_error(_interleaved_rope) > WRONG
    assert _relative_position_error(_interleaved_rope) < TOL  # (why the layout is checked)
    assert _relative_position_error(_squared_rope) > WRONG


LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_context": 8192}


def _metas_apply_scaling(freqs):
    """Meta's llama3.1 `apply_scaling` (llama-models, reference_impl/model.py), its constants
    in."""
    scale_factor, low_freq_factor, high_freq_factor, old_context_len = 8, 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = ((old_context_len / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return np.array(new_freqs)


def _scaling_error(inverse_frequencies):
    """`inverse_frequencies(head_dim, theta, scaling)`'s largest difference from Meta's scaling
    of Llama 3.1 8B's frequencies (head_dim 128, theta 500000), relative to each frequency."""
    base = (1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)).astype("float32")  # Meta's float32
    ours = np.asarray(inverse_frequencies(128, 500000.0, LLAMA31), np.float64)
    return float(np.max(np.abs(ours / _metas_apply_scaling(base) - 1)))


def _backwards_blend(head_dim, theta, scaling):
    """Wrong: the middle frequencies blended the other way round."""
    inv = rope.inverse_frequencies(head_dim, theta).astype(np.float64)
    s = scaling
    wavelength = 2 * math.pi / inv
    smooth = ((s["original_context"] / wavelength - s["low_freq_factor"])
              / (s["high_freq_factor"] - s["low_freq_factor"]))
    blended = smooth * inv / s["factor"] + (1 - smooth) * inv
    high = s["original_context"] / s["high_freq_factor"]
    low = s["original_context"] / s["low_freq_factor"]
    return np.where(wavelength < high, inv, np.where(wavelength > low, inv / s["factor"],
                                                     blended))


def test_llama31_scaling_is_metas_keeping_high_dividing_low_blending_between():
    """Against Meta's formula; and the three bands: wavelengths below 8192/4 keep their
    frequency, above 8192 it is divided by 8, between it lies strictly between the two."""
    assert _scaling_error(rope.inverse_frequencies) < 1e-6
    plain = rope.inverse_frequencies(128, 500000.0).astype(np.float64)
    scaled = rope.inverse_frequencies(128, 500000.0, LLAMA31).astype(np.float64)
    wavelength = 2 * math.pi / plain
    high, low = wavelength < 2048, wavelength > 8192
    middle = ~high & ~low
    assert high.sum() > 0 and low.sum() > 0 and middle.sum() > 2
    np.testing.assert_allclose(scaled[high], plain[high], rtol=1e-7)
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-6)
    assert np.all(scaled[middle] > plain[middle] / 8 * (1 + 1e-3))
    assert np.all(scaled[middle] < plain[middle] * (1 - 1e-3))


def test_the_scaling_check_finds_a_backwards_blend():
    """The companion: the middle band blended the other way round fails the check."""
    assert _scaling_error(_backwards_blend) > WRONG


# -- RMSNorm -----------------------------------------------------------------------------------

NORM_X = tf.constant(_normal((4, 8, 32), 3, scale=2.0, offset=0.7))  # a mean: LayerNorm differs
NORM_SCALE = _normal((32,), 4, scale=0.3, offset=1.0)


def _textbook_rms_norm(x, scale, eps):
    return x / tf.sqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + eps) * scale


def _with_grads(fn, x, scale):
    """fn(x, scale), and d(sum(fn * w))/d(x, scale) for a fixed random w."""
    with tf.GradientTape() as tape:
        tape.watch([x, scale])
        y = fn(x, scale)
        loss = tf.reduce_sum(y * tf.random.stateless_normal(tf.shape(y), (1, 2)))
    return [y, *tape.gradient(loss, [x, scale])]


def _rms_norm_errors(monkeypatch, rms_norm):
    """`rms_norm(x, scale, eps)` and the RMSNorm layer running it (its output, its input's and
    its scale's gradients) against TF's autodiff of the textbook x / sqrt(mean(x^2) + eps) * w."""
    monkeypatch.setattr(gpt, "rms_norm", rms_norm)  # what gpt.RMSNorm calls
    eps = 1e-5
    scale = tf.Variable(NORM_SCALE)
    reference = _with_grads(lambda x, s: _textbook_rms_norm(x, s, eps), NORM_X, scale)
    layer = gpt.RMSNorm(epsilon=eps)
    layer.build(NORM_X.shape)
    layer.scale.assign(NORM_SCALE)
    return (_close(_with_grads(lambda x, s: rms_norm(x, s, eps), NORM_X, scale), reference)
            + _close(_with_grads(lambda x, s: layer(x), NORM_X, layer.scale.value), reference))


def test_rms_norm_and_its_gradients_are_the_textbook_formula(monkeypatch):
    """fused.rms_norm and the gpt.RMSNorm layer: output and both gradients within 1e-5."""
    errors = _rms_norm_errors(monkeypatch, fused.rms_norm)
    assert max(errors) < TOL, errors


def test_the_rms_norm_check_finds_a_layer_norm(monkeypatch):
    """The companion: a LayerNorm (the mean subtracted) fails it, output and gradients."""
    def layer_norm(x, scale, eps):
        return fused.layer_norm(x, scale, None, eps)
    errors = _rms_norm_errors(monkeypatch, layer_norm)
    assert min(errors) > WRONG, errors


# -- the SwiGLU MLP ----------------------------------------------------------------------------

def _silu(x):
    return x / (1 + np.exp(-x))


def _textbook_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _swiglu_errors(monkeypatch, swiglu):
    """`swiglu` ([gate | up] -> silu(gate) * up) against the textbook, and a llama Block using
    it against x1 + silu(n W_gate) * (n W_up) W_down, n = RMSNorm(x1), x1 = x + attn(ln_1(x)),
    W_gate and W_up c_fc's kernel's halves, W_down mlp_c_proj's."""
    monkeypatch.setattr(gpt, "swiglu", swiglu)  # what Block.activation calls
    h = _normal((3, 5, 2 * 24), 5, scale=2.0)
    gate, up = h[..., :24].astype(np.float64), h[..., 24:].astype(np.float64)
    errors = _close([swiglu(h)], [_silu(gate) * up])
    keras.utils.set_random_seed(0)
    block = gpt.Block(32, 4, 2, bias=False, arch="llama", n_kv_head=2, ffn_hidden=24)
    x = _normal((2, 6, 32), 6)
    block(x)  # built
    for i, w in enumerate(block.weights):  # far from GPT-2's 0.02, so that the MLP shows
        norm = len(w.shape) == 1  # the norms' scales, about 1
        w.assign(_normal(w.shape, 10 + i, 0.2 if norm else 1 / math.sqrt(w.shape[0]),
                         1.0 if norm else 0.0))
    x1 = np.asarray(x + block.attn(block.ln_1(x)), np.float64)
    n = _textbook_rms(x1, np.asarray(block.ln_2.scale, np.float64), block.norm_eps)
    w_fc = np.asarray(block.c_fc.kernel, np.float64)
    w_gate, w_up = w_fc[:, :24], w_fc[:, 24:]
    mlp = (_silu(n @ w_gate) * (n @ w_up)) @ np.asarray(block.c_proj.kernel, np.float64)
    return errors + _close([np.asarray(block(x)) - x1], [mlp])


def test_swiglu_and_the_llama_blocks_mlp_are_the_textbook_gated_mlp(monkeypatch):
    errors = _swiglu_errors(monkeypatch, fused.swiglu)
    assert max(errors) < TOL, errors


def test_the_swiglu_check_finds_gate_and_up_swapped(monkeypatch):
    """The companion: silu(up) * gate fails it, alone and in the block."""
    def swapped(x):
        gate, up = keras.ops.split(x, 2, axis=-1)
        return keras.ops.silu(up) * gate
    errors = _swiglu_errors(monkeypatch, swapped)
    assert min(errors) > WRONG, errors


# -- grouped-query attention -------------------------------------------------------------------

def _textbook_gqa(q, k, v, n_head, n_kv_head, theta):
    """A loop over query heads: head h reads key/value head h // (n_head / n_kv_head), its
    query and key rotated (theta) or not (None), scores / sqrt(hd), the future masked, softmax."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    B, T, C = q.shape
    hd, group = C // n_head, n_head // n_kv_head
    positions = np.arange(T)
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(n_head):
            g = h // group
            qh, kh = q[b, :, h * hd:(h + 1) * hd], k[b, :, g * hd:(g + 1) * hd]
            vh = v[b, :, g * hd:(g + 1) * hd]
            if theta is not None:
                qh, kh = _textbook_rope(qh, positions, theta), _textbook_rope(kh, positions, theta)
            scores = qh @ kh.T / math.sqrt(hd)
            scores[np.triu(np.ones((T, T), bool), 1)] = -np.inf
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[b, :, h * hd:(h + 1) * hd] = p / p.sum(axis=-1, keepdims=True) @ vh
    return out


def _gqa_error(n_head, n_kv_head, theta):
    """gpt.attention's largest difference from the textbook loop."""
    hd, T = 8, 12
    q = _normal((2, T, n_head * hd), 8, scale=1.5)
    k, v = _normal((2, T, n_kv_head * hd), 9, 1.5), _normal((2, T, n_kv_head * hd), 10)
    inv = None if theta is None else rope.inverse_frequencies(hd, theta)
    y = gpt.attention(q, k, v, n_head, keras.layers.Dropout(0.0), False, n_kv_head, inv)
    return _close([y], [_textbook_gqa(q, k, v, n_head, n_kv_head, theta)])[0]


@pytest.mark.parametrize("n_head, n_kv_head, theta", [(4, 2, None), (4, 2, 10000.0),
                                                      (6, 3, 10000.0), (4, 1, 10000.0),
                                                      (4, 4, 10000.0)])
def test_grouped_query_attention_is_the_textbook_loop_over_heads(n_head, n_kv_head, theta):
    """Groups of 2 and 4 query heads, multi-query (1 kv head) and multi-head (4), with and
    without rotary embeddings."""
    assert _gqa_error(n_head, n_kv_head, theta) < TOL


class _TiledOps:
    """keras.ops, but its `repeat` tiles: GPT attention's query head h then reads key/value head
    h % n_kv_head instead of h // (n_head / n_kv_head)."""

    def __getattr__(self, name):
        return getattr(keras.ops, name)

    @staticmethod
    def repeat(x, repeats, axis):
        return keras.ops.tile(x, [repeats if a == axis else 1 for a in range(len(x.shape))])


def test_the_gqa_check_finds_heads_reading_the_wrong_kv_head(monkeypatch):
    """The companion: query head h reading key/value head h % n_kv_head fails it. (With one
    key/value head both read the same one: no difference there.)"""
    monkeypatch.setattr(gpt, "ops", _TiledOps())
    assert _gqa_error(4, 2, 10000.0) > WRONG
    assert _gqa_error(6, 3, None) > WRONG
    assert _gqa_error(4, 1, 10000.0) < TOL


# -- sampling over the key/value cache ---------------------------------------------------------

ARCHS = {"gpt2": {},
         "llama": dict(arch="llama", n_kv_head=2, bias=False, tie_embeddings=False,
                       ffn_hidden=48)}
BLOCK = 16


def _tiny(arch, seed=0, **kw):
    """A 2-layer, 4-head, 32-wide GPT of 64 tokens and a context of 16, its weights drawn at the
    scale 1/sqrt(fan-in) (not GPT-2's 0.02): the attention is far from uniform and the logits
    vary by units, so a wrong position or a stale cache entry moves them far beyond 1e-5."""
    keras.utils.set_random_seed(seed)
    m = GPT(vocab_size=64, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, **ARCHS[arch],
            **kw)
    m.build()
    for i, w in enumerate(m.weights):
        if len(w.shape) == 1:  # norms' scales (about 1), biases (about 0)
            one = w.path.endswith(("scale", "gamma"))
            w.assign(_normal(w.shape, seed * 100 + i, 0.2, 1.0 if one else 0.0))
        else:
            w.assign(_normal(w.shape, seed * 100 + i, 1 / math.sqrt(w.shape[0])))
    return m


def _decoded_in_pieces(m, tokens):
    """Logits of `tokens` (B, 12) through `GPT.decode`: the first 5 at once, then single tokens
    and one pair, over a cache of block_size positions (the last 4 never written)."""
    caches = m.empty_caches(tokens.shape[0], BLOCK)
    out = []
    for start, stop in [(0, 5), (5, 6), (6, 7), (7, 9), (9, 10), (10, 11), (11, 12)]:
        logits, caches = m.decode(tokens[:, start:stop], caches, start)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


def _tokens(shape, seed):
    return np.random.default_rng(seed).integers(0, 64, size=shape).astype("int32")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_decoding_over_the_cache_gives_the_full_forward_logits(arch):
    """At every position, within 1e-5 of the logits' largest magnitude."""
    m = _tiny(arch)
    tokens = _tokens((2, 12), 1)
    full = np.asarray(m(tokens))
    assert np.std(full) > 0.3  # (logits that vary)
    error = _close([_decoded_in_pieces(m, tokens)], [full])[0]
    assert error < TOL, error


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_cache_check_finds_a_decode_that_forgets_its_offset(arch, monkeypatch):
    """The companion: a decode that puts each call's tokens at positions from 0 (the position
    embedding and the rotation of the queries and keys) fails it after the prompt."""
    rotate, embed = rope.rotate, GPT.embed
    monkeypatch.setattr(rope, "rotate", lambda x, positions, inv: rotate(
        x, positions - positions[0], inv))
    monkeypatch.setattr(GPT, "embed", lambda self, idx, training=False, offset=0: embed(
        self, idx, training))
    m = _tiny(arch)
    tokens = _tokens((2, 12), 1)
    full, decoded = np.asarray(m(tokens)), _decoded_in_pieces(m, tokens)
    assert _close([decoded[:, :5]], [full[:, :5]])[0] < TOL  # the prompt's pass is right
    assert _close([decoded[:, 5:]], [full[:, 5:]])[0] > WRONG


def _windows(prompt, total, block_size):
    """(n, s): the token at n is predicted from tokens s..n-1, as `generate` documents it: a
    prompt cut to its last block_size tokens, and the context started again from the last half
    of it when it would exceed block_size."""
    length = min(block_size, total)
    s = max(0, prompt - length)
    for n in range(prompt, total):
        if n - s > length:
            s = n - max(1, length // 2)
        yield n, s


def _greedy_picks(m, tokens, prompt, starts):
    """For each generated token, whether its logit is the largest (within 1e-5 of the logits'
    scale: a tie within rounding may go either way) given tokens starts(n)..n-1."""
    picks = []
    for n, s in starts(prompt, tokens.shape[1], m.block_size):
        logits = np.asarray(m(tokens[:, s:n]))[:, -1]
        chosen = np.take_along_axis(logits, tokens[:, n:n + 1], axis=1)[:, 0]
        picks.extend(logits.max(axis=1) - chosen <= TOL * np.abs(logits).max())
    return picks


def _sliding(prompt, total, block_size):
    """nanoGPT's window, which `generate` does not use: the last block_size tokens."""
    return ((n, max(0, n - block_size)) for n in range(prompt, total))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_top_k_1_is_greedy_decoding_by_full_forward_passes(arch):
    """Within the context, beyond it (30 new tokens after 3, the context 16), and after a prompt
    longer than the context; a batch of 2."""
    m = _tiny(arch)
    short = m.generate(_tokens((2, 3), 2), 30, top_k=1, seed=0)
    assert short.shape == (2, 33)
    assert all(_greedy_picks(m, short, 3, _windows))
    assert not all(_greedy_picks(m, short, 3, _sliding))  # (the check sees the windows)
    long = m.generate(_tokens((2, 20), 3), 5, top_k=1, seed=0)
    assert long.shape == (2, 25)
    assert all(_greedy_picks(m, long, 20, _windows))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_generating_again_with_the_same_shapes_traces_nothing(arch):
    """One prefill and one step function per prompt length and sampling setting, each traced
    once: 30 tokens after 3 use those of the 3-token prompt and of the 8-token restart; again
    (another prompt, another seed) nothing new; another prompt length, one pair more."""
    m = _tiny(arch)

    def traces():
        return {key: tuple(f.experimental_get_tracing_count() for f in fns)
                for key, fns in m._decoders.items()}
    m.generate(_tokens((1, 3), 4), 30, temperature=0.8, top_k=5, seed=1)
    first = traces()
    assert len(first) == 2 and set(first.values()) == {(1, 1)}
    m.generate(_tokens((1, 3), 5), 30, temperature=0.8, top_k=5, seed=2)
    assert traces() == first
    m.generate(_tokens((1, 4), 5), 30, temperature=0.8, top_k=5, seed=2)
    assert len(traces()) == 3 and set(traces().values()) == {(1, 1)}


def test_a_llama_model_comes_back_from_a_keras_file_with_equal_logits(tmp_path):
    """Its weights (the untied head's too) and its config's Llama keys, Llama 3.1's scaling
    included; saved after generating (the compiled functions are not saved)."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_context": 64}  # (a context that this head width's wavelengths pass)
    m = _tiny("llama", rope_theta=20000.0, rope_scaling=scaling, norm_eps=1e-6)
    m.generate(_tokens((1, 3), 6), 4, seed=0)
    config = m.get_config()
    expected = {"arch": "llama", "n_kv_head": 2, "bias": False, "tie_embeddings": False,
                "ffn_hidden": 48, "rope_theta": 20000.0, "rope_scaling": scaling,
                "norm_eps": 1e-6}
    assert {k: config[k] for k in expected} == expected
    assert GPT.from_config(config).get_config() == config
    path = str(tmp_path / "llama.keras")
    m.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, GPT) and loaded.get_config() == config
    assert loaded.wpe is None and loaded.lm_head is not None
    inv = loaded.blocks[0].attn.inv_freq
    np.testing.assert_allclose(inv, rope.inverse_frequencies(8, 20000.0, scaling), rtol=1e-7)
    assert np.abs(inv / rope.inverse_frequencies(8, 20000.0) - 1).max() > 0.5  # (scaled)
    tokens = _tokens((2, 12), 7)
    assert _close([loaded(tokens)], [m(tokens)])[0] < 1e-6
