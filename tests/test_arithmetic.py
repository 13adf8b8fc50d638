"""tfdist.models.arithmetic is the one copy of the transformer arithmetic: its parameter count is
the built Keras GPT's, the GPT's FLOPs are its figure, and the pipeline's memory estimate and
`tfdist plan` count the same activation bytes for the same model and layout."""
import doctest

import pytest

from tfdist import plan
from tfdist.models import arithmetic
from tfdist.models.gpt import GPT
from tfdist.models.pipeline import Pipeline, block_costs

CONFIGS = [  # GPT(...) keyword arguments
    dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32),
    dict(vocab_size=300, block_size=24, n_layer=3, n_head=4, n_embd=48, bias=False),
    dict(vocab_size=97, block_size=16, n_layer=1, n_head=3, n_embd=24, dropout=0.1, bias=False),
]


def sizes(kw):
    """The GPT's sizes as the arithmetic module and the planner name them."""
    return dict(n_layer=kw["n_layer"], n_embd=kw["n_embd"], n_head=kw["n_head"],
                vocab_size=kw["vocab_size"], seq_len=kw["block_size"], bias=kw.get("bias", True),
                dropout=kw.get("dropout", 0.0) > 0)


def test_the_docstring_example_runs():
    result = doctest.testmod(arithmetic)
    assert result.attempted >= 5 and result.failed == 0


@pytest.mark.parametrize("kw", CONFIGS, ids=["bias", "no-bias", "no-bias-dropout"])
def test_parameter_count_is_the_built_keras_models(kw):
    gpt = GPT(**kw)
    gpt.build()
    counted = gpt.count_params()  # Keras, from the variables it built
    arch = arithmetic.Transformer(**sizes(kw))
    assert arch.params() == counted
    assert arch.n_layer * arch.layer_params() == sum(b.count_params() for b in gpt.blocks)
    assert arch.layer_params() == gpt.blocks[0].count_params()
    assert arch.non_embedding_params() == counted - kw["block_size"] * kw["n_embd"]  # less wpe
    assert (gpt.num_params() == counted
            and gpt.num_params(non_embedding=True) == arch.non_embedding_params())
    assert plan.Model(name="gpt", **sizes(kw)).params == counted  # the planner counts the same


@pytest.mark.parametrize("kw", CONFIGS, ids=["bias", "no-bias", "no-bias-dropout"])
def test_gpt_flops_per_token_is_the_modules(kw):
    gpt = GPT(**kw)
    gpt.build()
    arch = arithmetic.Transformer(**sizes(kw))
    L, C, T = kw["n_layer"], kw["n_embd"], kw["block_size"]
    nanogpt = 6 * (gpt.count_params() - T * C) + 12 * L * C * T  # nanoGPT's estimate_mfu
    assert gpt.flops_per_token() == arch.flops_per_token() == nanogpt
    assert (gpt.flops_per_token(seq_len=8) == arch.flops_per_token(8)
            == nanogpt - 12 * L * C * (T - 8))
    blocks, embed, head = block_costs(gpt)  # the pipeline balances its stages by the same FLOPs
    assert blocks == [plan.Model(name="gpt", **sizes(kw)).layer_flops()] * L
    assert (embed, head) == (arch.embedding_flops(), arch.head_flops())


@pytest.mark.parametrize("precision", ["float32", "mixed"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_pipeline_estimate_and_planner_count_the_same_activations(precision, recompute, dropout):
    kw = dict(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32, dropout=dropout)
    batch, stages, m = 16, 2, 4
    # Both stages on one CPU: the estimate needs no second device (nor a built model).
    pipe = Pipeline(GPT(**kw), stages=stages, microbatches=m, devices=["/cpu:0"] * stages,
                    recompute=recompute)
    assert pipe.layers_per_stage == [2, 2]  # as the planner's even split
    rows = pipe.memory_estimate(batch, precision)

    model = plan.Model(name="gpt", **sizes(kw))
    layout = plan.planned(batch, 1, pp=stages, microbatch=batch // m, recompute=recompute)
    tokens = batch // m * kw["block_size"]
    per_layer = plan.activation_bytes_per_layer(model, layout, tokens, precision)
    assert per_layer == model.activation_bytes_per_layer(tokens, precision)
    assert [r["activation_bytes_per_block"] for r in rows] == [int(per_layer)] * stages
    planned = plan.memory(model, layout, plan.Options(precision=precision, schedule="gpipe"))
    kept = model.activation_bytes_per_layer(tokens, precision, recompute=True)
    logits = m * model.logits_bytes(tokens)
    if recompute:  # tfdist recomputes a stage whole (its input kept), the planner layer by layer
        assert rows[-1]["activation_bytes"] == int(m * kept + 2 * per_layer + logits)
        assert planned["activations"] == 2 * m * kept + per_layer + logits
    else:  # the last stage: its blocks for all M microbatches in flight (GPipe), and its logits
        assert rows[-1]["activation_bytes"] == int(planned["activations"])
        assert rows[0]["activation_bytes"] == pytest.approx(planned["activations"] - logits, abs=1)


def test_activation_bytes_are_korthikantis_and_state_bytes_the_zero_papers():
    """s b h (34 + 5 a s / h) bytes in mixed precision with dropout (values twice as wide in
    float32, the 1-byte masks not); model states 16 bytes per parameter with Adam either way
    (ZeRO's K = 12 in mixed precision)."""
    a = arithmetic.Transformer(n_layer=2, n_embd=64, n_head=4, vocab_size=100, seq_len=128)
    s, h, heads, b = 128, 64, 4, 3
    assert a.activation_bytes_per_layer(b * s, "mixed") == s * b * h * (34 + 5 * heads * s / h)
    assert a.activation_bytes_per_layer(b * s, "float32") == s * b * h * (66 + 9 * heads * s / h)
    assert a.activation_bytes_per_layer(b * s, "mixed", recompute=True) == s * b * h * 2
    assert arithmetic.STATE_BYTES == {"mixed": (2, 2, 12), "float32": (4, 4, 8)}
    assert arithmetic.state_bytes_per_param("float32", optimizer_slots=1) == (4, 4, 4)
    with pytest.raises(ValueError, match="precision"):
        arithmetic.state_bytes_per_param("fp8")
