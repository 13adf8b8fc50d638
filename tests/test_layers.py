"""Per-layer decisions (tfdist/plan/layers.py): for tfdist's GPT with a 50k vocabulary on 4
devices, the dynamic program splits the token embedding by vocabulary rows where a device's memory
requires it and keeps it whole where it does not; a memory model that ignores the embedding (the
companion) keeps it whole under the same budget, and then does not fit. The plan's layout map runs
on a mesh of 4 logical CPUs (tfdist.parallel.mesh) with the embedding a quarter on each device and
one device's losses. `tfdist plan --per_layer` prints and writes it."""
import dataclasses
import json
import sys

import pytest

from tests.helpers import run
from tfdist.errors import UsageError
from tfdist.plan import layers
from tfdist.plan import model as plan_model

GPT = plan_model.Model(name="gpt-50k", n_layer=4, n_embd=512, n_head=8, vocab_size=50304,
                       seq_len=256)
RATES = layers.Rates(flops=100e9, allreduce_bw=1e9)
TOKENS = 4 * 256


def needs(split_wte):
    """A device's bytes with every block split and the embedding as asked."""
    opts = layers.options(GPT, 4, TOKENS, RATES)
    return layers.fixed_bytes(GPT, TOKENS) + sum(
        o[1].bytes if (name != "wte" or split_wte) else o[0].bytes for name, o in opts.items())


def test_the_embedding_is_split_where_memory_requires_it_and_not_elsewhere():
    roomy = layers.plan(GPT, 4, TOKENS, budget=4 * 2 ** 30, rates=RATES, recompute=False)
    assert roomy.split["wte"] is False  # splitting it costs an all-reduce a step, and it fits
    tight_budget = (needs(True) + needs(False)) / 2  # only a split embedding fits
    tight = layers.plan(GPT, 4, TOKENS, budget=tight_budget, rates=RATES, recompute=False)
    assert tight.split["wte"] is True and tight.bytes <= tight_budget
    assert tight.layout_map()["gpt/wte/embeddings"] == ("model", None)
    assert "gpt/wte/embeddings" not in roomy.layout_map()
    # the fastest within the budget: no single layer kept whole instead would still fit
    assert all(tight.bytes - o[1].bytes + o[0].bytes > tight_budget
               for name, o in tight.options.items() if tight.split[name] and name == "wte")


def test_a_memory_model_that_ignores_the_embedding_keeps_it_whole_and_does_not_fit():
    """The companion: the same program with the embedding's memory left out picks it whole at the
    tight budget, where it does not fit."""
    tight_budget = (needs(True) + needs(False)) / 2
    blind = layers.plan(GPT, 4, TOKENS, budget=tight_budget, rates=RATES, recompute=False,
                        memory_of=lambda kind, params: 0.0 if kind == "wte" else 16 * params)
    assert blind.split["wte"] is False
    real = layers.fixed_bytes(GPT, TOKENS) + sum(
        o[int(blind.split[name])].bytes for name, o in layers.options(GPT, 4, TOKENS,
                                                                       RATES).items())
    assert real > tight_budget


def test_blocks_recompute_where_their_activations_do_not_fit_otherwise():
    """Below what every layer split needs with every block's activations kept, the program
    recomputes blocks (their input kept, their forward run again), as few as fit; the companion,
    without that option, finds nothing that fits."""
    opts = layers.options(GPT, 4, TOKENS, RATES, recompute=True)
    kept = layers.fixed_bytes(GPT, TOKENS) + sum(o[1].bytes for o in
                                                 layers.options(GPT, 4, TOKENS, RATES).values())
    one = opts["remat.0"][0].bytes - opts["remat.0"][1].bytes  # what recomputing a block saves
    budget = kept - 1.5 * one  # at least two blocks must recompute
    p = layers.plan(GPT, 4, TOKENS, budget, RATES)
    assert len(p.recomputed()) >= 2 and p.bytes <= budget, p.split
    assert p.bytes + one > budget  # as few as fit: one fewer would not (the time they cost)
    assert p.to_json()["recompute"] == p.recomputed()
    with pytest.raises(UsageError, match="no per-layer split"):
        layers.plan(GPT, 4, TOKENS, budget, RATES, recompute=False)


def test_nothing_fits_is_one_line():
    with pytest.raises(UsageError, match="no per-layer split of the model fits"):
        layers.plan(GPT, 4, TOKENS, budget=0.1 * 2 ** 30, rates=RATES)


def test_the_command_prints_and_writes_the_map(tmp_path):
    p = run([sys.executable, "-m", "tfdist", "plan", "--per_layer", "--config=configs/gpt2.py",
             "--devices=4", "--device=cpu", "--batch=1", "--seq_len=256", "--memory_gb=1",
             f"--out={tmp_path}"], timeout=120)
    assert "wte        split" in p.stdout, p.stdout
    saved = json.loads((tmp_path / "layout_map.json").read_text())
    assert saved["layout_map"]["gpt/wte/embeddings"] == ["model", None]


@pytest.mark.slow
def test_the_plans_map_runs_on_a_mesh_of_4_logical_cpus(tmp_path):
    """tfdist's Llama-kind GPT (vocabulary 4096) planned for 4 devices under a budget that only
    every layer split and every block recomputed meets: on a (1, 4) mesh the embedding and the
    head are a quarter on each device, the blocks recompute (keras.remat), and the losses are
    one device's."""
    from tests.test_mesh import PROBE, assert_equal_to_one_device
    small = dataclasses.replace(GPT, n_layer=2, n_embd=16, n_head=4, n_kv_head=2,
                                vocab_size=4096, seq_len=8, gated_mlp=True, ffn=64,
                                tied_embeddings=False, learned_positions=False, rms_norm=True)
    opts = layers.options(small, 4, 64, RATES, recompute=True)
    fixed = layers.fixed_bytes(small, 64, recompute=True)
    least = fixed + sum(o[1].bytes for o in opts.values())
    # room for every layer split and every block recomputed, and a little more: only that fits
    budget = least * 1.001
    p = layers.plan(small, 4, 64, budget, RATES)
    assert p.split["wte"] and p.split["head"] and p.recomputed() == [0, 1], p.split
    path = tmp_path / "layout_map.json"
    layers.write(p, str(path))
    out = tmp_path / "result.json"
    run([sys.executable, PROBE, "gpt_llama", "--mesh=1x4", "--vocab=4096", f"--plan={path}",
         f"--out={out}"], timeout=300)
    result = json.loads(out.read_text())
    for name, key in (("wte", "gpt/wte/embeddings"), ("head", "gpt/lm_head/kernel")):
        v = result["sharding"][key]
        assert set(v["devices"].values()) == {v["whole"] // (4 if p.split[name] else 1)}, v
    v = result["sharding"]["gpt/h_0/c_fc/kernel"]
    assert set(v["devices"].values()) == {v["whole"] // (4 if p.split["mlp.0"] else 1)}
    assert_equal_to_one_device(result, generate=False)


# -- a user's Keras model under keras.distribution ---------------------------------------------


def embed_model():
    import keras
    inputs = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(4096, 16, name="embed")(inputs)
    h = keras.layers.Dense(32, activation="relu", name="up")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="down")(h))


def test_a_keras_models_embedding_is_split_where_memory_requires_it():
    """A plain Keras model (an Embedding of 4096 x 16, two Dense layers) on 4 devices: with room
    every kernel stays whole (a split costs collectives); under a budget that only a split
    embedding meets, its vocabulary rows are split; a memory model that ignores the embedding
    keeps it whole under the same budget (the companion), and then does not fit."""
    model = embed_model()
    opts, paths, rest = layers.keras_options(model, 4, 8, RATES)
    assert paths == {"embed": "embed/embeddings", "up": "up/kernel", "down": "down/kernel"}
    assert [o.axes for o in opts["up"]] == [None, ("model", None), (None, "model")]
    assert layers.keras_plan(model, 4, 8, 10e6, RATES).layout_map() == {}
    embed_whole, embed_split = opts["embed"][0].bytes, opts["embed"][1].bytes
    budget = rest + sum(o[0].bytes for o in opts.values()) - (embed_whole - embed_split) / 2
    tight = layers.keras_plan(model, 4, 8, budget, RATES)
    assert tight.layout_map().get("embed/embeddings") == ("model", None) and tight.bytes <= budget
    blind = layers.keras_plan(model, 4, 8, budget, RATES, memory_of=lambda kind, params: (
        0.0 if kind == "embedding" else 16 * params))
    assert "embed/embeddings" not in blind.layout_map()
    assert rest + sum(opts[n][k].bytes for n, k in blind.picks.items()) > budget


@pytest.mark.slow
def test_a_keras_models_plan_runs_on_a_mesh(tmp_path):
    """The tight plan above, written and read back as keras.distribution's LayoutMap: on a (1, 4)
    mesh of logical CPUs the embedding is a quarter on each device, and the losses are one
    device's."""
    from tests.test_mesh import PROBE, assert_equal_to_one_device
    model = embed_model()
    opts, _, rest = layers.keras_options(model, 4, 8, RATES)
    budget = rest + sum(o[0].bytes for o in opts.values()) - (
        opts["embed"][0].bytes - opts["embed"][1].bytes) / 2
    path = tmp_path / "layout_map.json"
    layers.write(layers.keras_plan(model, 4, 8, budget, RATES), str(path))
    out = tmp_path / "result.json"
    run([sys.executable, PROBE, "embed", "--mesh=1x4", f"--plan={path}", f"--out={out}"],
        timeout=300)
    result = json.loads(out.read_text())
    v = result["sharding"]["embed/embeddings"]
    assert set(v["devices"].values()) == {v["whole"] // 4}, v
    assert_equal_to_one_device(result, generate=False)
