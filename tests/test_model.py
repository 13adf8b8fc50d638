"""The GPT model: parameter counts, causality, serialization, generation."""
import os

import keras
import numpy as np
import pytest

from tfdist.models.gpt import GPT


def nano(**kw):
    args = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    args.update(kw)
    m = GPT(**args)
    m.build()
    return m


def test_gpt2_124m_has_exactly_124439808_parameters():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "gpt2", os.path.join(os.path.dirname(__file__), "..", "configs", "gpt2.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = GPT.from_model_config(mod.get_config().model)
    model.build()
    assert model.num_params() == 124_439_808


def test_changing_token_t_plus_1_never_changes_logits_at_or_before_t():
    keras.utils.set_random_seed(0)
    m = nano()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(2, 32)).astype("int32")
    base = np.asarray(m(x))
    for t in (0, 7, 30):
        y = x.copy()
        y[:, t + 1] = (y[:, t + 1] + 1) % 256
        out = np.asarray(m(y))
        np.testing.assert_array_equal(out[:, :t + 1], base[:, :t + 1])
        assert np.abs(out[:, t + 1] - base[:, t + 1]).max() > 1e-6  # the change is visible at t+1


def test_head_is_tied_to_token_embedding():
    m = nano()
    assert sum("embeddings" in w.path for w in m.trainable_weights) == 2  # wte, wpe: no head matrix
    x = np.arange(10, dtype="int32")[None]
    h = m.wte(x) + m.wpe(np.arange(10, dtype="int32"))[None]
    for block in m.blocks:
        h = block(h)
    expected = np.asarray(m.ln_f(h)) @ np.asarray(m.wte.embeddings).T
    np.testing.assert_allclose(np.asarray(m(x)), expected, rtol=1e-5, atol=1e-5)


def test_get_config_from_config_and_keras_file_round_trip(tmp_path):
    keras.utils.set_random_seed(0)
    m = nano(dropout=0.1, bias=False)
    m2 = GPT.from_config(m.get_config())
    assert m2.get_config() == m.get_config()
    x = np.arange(20, dtype="int32").reshape(1, 20)
    path = str(tmp_path / "m.keras")
    m.compile(optimizer="adamw", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    m.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, GPT)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(m(x)))


def test_generate_shapes_determinism_and_top_k_1_is_greedy():
    keras.utils.set_random_seed(0)
    m = nano()
    prompt = np.array([104, 105], "int32")
    a = m.generate(prompt, 10, temperature=0.9, top_k=5, seed=3)
    b = m.generate(prompt, 10, temperature=0.9, top_k=5, seed=3)
    assert a.shape == (1, 12) and (a == b).all() and (a[0, :2] == prompt).all()
    # Greedy: each token has the largest logit given the tokens before it. (generate computes
    # its logits in a tf.function, this check eagerly: other kernels, so a tie within rounding
    # may go either way, and a logit within 1e-5 of the largest counts as the largest.)
    def argmax_picks(tokens):
        picks = []
        for t in range(2, tokens.shape[1]):
            logits = np.asarray(m(tokens[:, :t]))[0, -1]
            picks.append(logits.max() - logits[tokens[0, t]] <= 1e-5)
        return picks
    greedy = m.generate(prompt, 5, top_k=1, seed=0)
    assert greedy.shape == (1, 7) and all(argmax_picks(greedy))
    assert not all(argmax_picks(a))  # the companion: sampling (top_k=5) picks others too
    long = m.generate(prompt, 40, seed=0)  # longer than block_size: context is cropped
    assert long.shape == (1, 42)


def test_flops_per_token_follows_nanogpt_formula():
    m = nano()
    n = m.num_params(non_embedding=True)
    assert m.flops_per_token() == 6 * n + 12 * 2 * 32 * 32


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="prompt"):
        nano().generate(np.zeros((1, 0), "int32"), 3)
