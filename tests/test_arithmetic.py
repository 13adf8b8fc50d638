"""tfdist.models.arithmetic is the one copy of the transformer arithmetic: its parameter count is
the built Keras GPT's, the GPT's FLOPs are its figure, and the pipeline's memory estimate and
`tfdist plan` count the same activation bytes for the same model and layout."""
import dataclasses
import doctest
import math

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


# --- Llama's kind: grouped-query attention, SwiGLU, RMSNorm, no position embeddings ------------

LLAMA = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, arch="llama",
             n_kv_head=2)


def llama_sizes(kw, gpt):
    """A llama GPT's sizes as the arithmetic module names them (written out here, not taken from
    `GPT.arch_sizes`, so that a wrong mapping there fails too)."""
    return dict(n_layer=kw["n_layer"], n_embd=kw["n_embd"], n_head=kw["n_head"],
                vocab_size=kw["vocab_size"], seq_len=kw["block_size"], bias=kw["bias"],
                dropout=False, n_kv_head=kw["n_kv_head"], ffn=gpt.ffn_hidden, gated_mlp=True,
                tied_embeddings=kw["tie_embeddings"], learned_positions=False, rms_norm=True)


@pytest.mark.parametrize("bias, tied", [(False, False), (True, False), (False, True)],
                         ids=["llama", "llama-bias", "llama-tied"])
def test_llama_parameter_count_is_the_built_keras_models(bias, tied):
    kw = dict(LLAMA, bias=bias, tie_embeddings=tied)
    gpt = GPT(**kw)
    gpt.build()
    counted = gpt.count_params()  # Keras, from the variables it built
    arch = arithmetic.Transformer(**llama_sizes(kw, gpt))
    assert gpt.ffn_hidden == 64 * math.ceil(8 * 32 / 3 / 64) == 128  # Llama's default width
    assert arch.params() == gpt.num_params() == counted
    assert plan.Model(name="llama", **llama_sizes(kw, gpt)).params == counted
    assert arch.layer_params() == gpt.blocks[0].count_params()
    # by hand: q and out h x h, k and v h x h/2 (2 of 4 heads), gate, up and down h x 128; two
    # RMSNorm scales h (no shift, also with biases); biases q h, k and v h/2 each, out h, gate
    # and up 128 each, down h
    h, f = 32, 128
    layer = 2 * h * h + 2 * h * h // 2 + 3 * h * f + 2 * h + (bias and 3 * h + 2 * f + h)
    head = 0 if tied else 64 * h
    assert counted == 2 * layer + 64 * h + head + h  # layers, wte, lm_head, the final norm
    # what wrong formulas would count instead: a LayerNorm shift with biases, keys and values
    # as wide as the queries, a two-matrix (GELU) MLP, or a head tied when it is not
    if bias:
        assert dataclasses.replace(arch, rms_norm=False).params() != counted
    assert dataclasses.replace(arch, n_kv_head=0).params() != counted
    assert dataclasses.replace(arch, gated_mlp=False).params() != counted
    assert dataclasses.replace(arch, tied_embeddings=not tied).params() != counted


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_flops_per_token_leave_out_only_the_looked_up_embedding(tied):
    """6 N + 12 L C T, N without the embeddings only looked up: Llama has no position embedding,
    and its untied token embedding is only looked up (its head multiplies: torchtitan's count);
    tied, the token embedding is the head and stays."""
    kw = dict(LLAMA, bias=False, tie_embeddings=tied)
    gpt = GPT(**kw)
    gpt.build()
    L, C, T, V = kw["n_layer"], kw["n_embd"], kw["block_size"], kw["vocab_size"]
    n = gpt.count_params() - (0 if tied else V * C)
    assert gpt.num_params(non_embedding=True) == n
    assert gpt.flops_per_token() == 6 * n + 12 * L * C * T
    # the companion: counting the untied lookup (N = every parameter) is 6 V C FLOPs too many;
    # the attention term counts the queries' width C, not the keys' (GQA shares keys, not scores)
    if not tied:
        assert gpt.flops_per_token() == 6 * gpt.count_params() + 12 * L * C * T - 6 * V * C
    # Megatron's count (matmuls, attention, head) is the same but for the norms' scales
    arch = gpt.arch_sizes
    assert arch.model_flops_per_token() == gpt.flops_per_token() - 6 * (2 * L + 1) * C


def test_llama3_8b_flops_per_token_by_hand():
    """Llama 3 8B at its 8,192-token context: N = 8,030,261,248 parameters less the untied token
    embedding's 128,256 x 4,096 = 7,504,924,672; 6 N + 12 x 32 x 4,096 x 8,192."""
    m = plan.MODELS["llama3-8b"]
    assert m.non_embedding_params() == 8_030_261_248 - 128_256 * 4_096 == 7_504_924_672
    assert m.flops_per_token() == 6 * 7_504_924_672 + 12 * 32 * 4_096 * 8_192 == 57_914_449_920
    # a wrong N: every parameter (the lookup counted as a matmul) gives 61,066,469,376 (+5.4 %);
    # attention over the 8 key/value heads' width (12 L kv T) gives 48,250,773,504
    assert m.flops_per_token() != 6 * m.params + 12 * 32 * 4_096 * 8_192
    assert m.flops_per_token() != 6 * 7_504_924_672 + 12 * 32 * 1_024 * 8_192
    # Megatron-LM's count for MFU agrees but for the 65 norm scales (6 FLOPs per parameter)
    assert m.model_flops_per_token() == m.flops_per_token() - 6 * 65 * 4_096


def test_llama_activations_count_grouped_keys_and_three_mlp_matrices():
    """Korthikanti's s b h (34 + 5 a s / h), for Llama: no dropout masks; the keys' and values'
    inputs kv / h as wide; SwiGLU keeps its gate, up, their activation and product (4 x 2 ffn / h
    bytes per value against GELU's 2 x 2 x 4); the scores 2 a s / h (no dropout)."""
    m = plan.MODELS["llama3-8b"]  # FlashAttention, as Meta trained it: no scores
    s, h, a = 8192, 4096, 32
    per_token = 8 + 4 + 4 * 1024 / h + 8 * 14336 / h  # 41: norms and inputs, q/out, k/v, MLP
    assert per_token == 41
    assert m.activation_bytes_per_layer(s, "mixed") == s * h * per_token
    tfdist = dataclasses.replace(m, flash_attention=False)  # tfdist's attention keeps the scores
    assert tfdist.activation_bytes_per_layer(s, "mixed") == s * h * (per_token + 2 * a * s / h)
    # the companions: multi-head keys and values (4 instead of 1) or a GELU MLP 14336 wide
    # (4 instead of 8 per ffn / h) count other bytes
    assert dataclasses.replace(m, n_kv_head=0).activation_bytes_per_layer(s) == s * h * (
        per_token + 3)
    assert dataclasses.replace(m, gated_mlp=False).activation_bytes_per_layer(s) == s * h * (
        per_token - 4 * 14336 / h)
