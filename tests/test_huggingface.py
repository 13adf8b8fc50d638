"""Hugging Face checkpoints in and out (tfdist/models/huggingface.py): a tiny random GPT-2 and a
tiny random Llama, made with transformers here, give tfdist's GPT the logits transformers
computes (within 1e-4, fp32) unsplit, tensor-parallel with sequence parallelism and in 2
pipeline stages, from one safetensors file or from shards; tfdist's own GPT exported loads in
transformers with its logits; fine-tuning starts at transformers' loss and lowers it; bad
checkpoints and layouts are one line each (exit 2)."""
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
import transformers

from tests.helpers import (
    ROOT,
    assert_usage_error,
    driver_group,
    first_fast,
    losses,
    metrics,
    run,
    tfdist,
)

PROBE = os.path.join(ROOT, "tests", "support", "hf_probe.py")
TOL = 1e-4  # the bound for fp32 logits (measured: ~1e-7; a wrong mapping: ~1e-1)
VOCAB = 300  # a byte-level BPE needs the 256 bytes and some merges


def _gpt2_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=4, bos_token_id=0, eos_token_id=0)


def _llama_config():
    # GQA (4 query heads over 2 key/value heads), an untied head, and Llama 3.1's rotary scaling
    # with every band in use: head width 8 at theta 5e5 has wavelengths 6.3 (blended between
    # 16/4 and 16/1), 167, 4443 and 1.2e5 (stretched 8x)
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})


MAKERS = {"gpt2": (_gpt2_config, transformers.GPT2LMHeadModel),
          "llama": (_llama_config, transformers.LlamaForCausalLM)}


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{arch: directory} of tiny random checkpoints, each with reference ids and transformers'
    logits for them; "<arch>-sharded": the same weights in several safetensors files; the llama
    one has a tokenizer.json (a BPE of 300 tokens)."""
    from tfdist.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("hf")
    ids = np.random.RandomState(0).randint(0, VOCAB, (2, 16))
    out = {}
    for arch, (config, cls) in MAKERS.items():
        torch.manual_seed(0)
        model = cls(config()).eval()
        directory = root / arch
        model.save_pretrained(directory)
        model.save_pretrained(root / f"{arch}-sharded", max_shard_size="40KB")
        for d in (directory, root / f"{arch}-sharded"):
            np.save(d / "reference_ids.npy", ids)
            np.save(d / "reference_logits.npy", _logits(model, ids))
        out[arch], out[f"{arch}-sharded"] = str(directory), str(root / f"{arch}-sharded")
    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read()
    train_bpe([text], vocab_size=VOCAB).save(out["llama"])
    with open(root / "corpus.txt", "w") as f:
        f.write(text * 4)
    out["corpus"] = str(root / "corpus.txt")
    return out


def probe(directory, layout):
    p = run([sys.executable, PROBE, directory, layout], timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE "):])


@pytest.mark.parametrize("arch,layout", first_fast([
    ("llama", "tp_sp"), ("gpt2", "tp_sp"), ("llama", "single"), ("gpt2", "single"),
    ("llama", "stages"), ("gpt2", "stages")]))
def test_logits_equal_transformers_in_every_layout(checkpoints, arch, layout):
    r = probe(checkpoints[arch], layout)
    assert r["max_diff"] <= TOL, r
    assert r["scale"] > 0.1  # the logits compared are not all ~0
    if layout == "tp_sp":
        assert "tensor parallel over 2 devices, sequence parallel" in r["describe"]
    if layout == "stages":
        assert r["describe"].startswith("pipeline of 2 stages")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_sharded_checkpoint_loads_the_same_weights(checkpoints, arch):
    from tfdist.models import huggingface

    directory = checkpoints[f"{arch}-sharded"]
    shards = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(directory, huggingface.INDEX))
    gpt, _ = huggingface.load_gpt(directory)
    ids = np.load(os.path.join(directory, "reference_ids.npy")).astype("int32")
    reference = np.load(os.path.join(directory, "reference_logits.npy"))
    assert np.abs(np.asarray(gpt(ids)) - reference).max() <= TOL


def test_a_wrong_mapping_is_caught_by_the_comparison(checkpoints):
    """The companion: Llama's keys and values loaded the other way round (c_attn's k and v
    columns swapped) give logits far outside the bound the tests above hold."""
    from tfdist.models import huggingface, state

    directory = checkpoints["llama"]
    gpt, _ = huggingface.load_gpt(directory)
    kernel = state.weights(gpt)["h_0/attn/c_attn/kernel"]
    q, k, v = np.split(np.asarray(kernel), np.cumsum(gpt.blocks[0].attn.qkv_widths)[:-1], -1)
    kernel.assign(np.concatenate([q, v, k], axis=-1))
    ids = np.load(os.path.join(directory, "reference_ids.npy")).astype("int32")
    reference = np.load(os.path.join(directory, "reference_logits.npy"))
    assert np.abs(np.asarray(gpt(ids)) - reference).max() > 100 * TOL


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tfdist_gpt_exported_loads_in_transformers_with_equal_logits(tmp_path, arch):
    """A GPT made by tfdist (random, untied head for Llama, tied for GPT-2) -> `export` ->
    transformers' `from_pretrained` -> the same logits; and back into tfdist."""
    import keras

    from tfdist.models import huggingface
    from tfdist.models.gpt import GPT

    keras.utils.set_random_seed(1)
    llama = dict(arch="llama", n_kv_head=2, bias=False, tie_embeddings=False, rope_theta=5e5)
    gpt = GPT(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32,
              **(llama if arch == "llama" else {}))
    gpt.build()
    huggingface.export(gpt, tmp_path / "out")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == huggingface.hf_config(gpt)["architectures"][0]
    ids = np.random.RandomState(2).randint(0, VOCAB, (2, 16))
    ours = np.asarray(gpt(ids.astype("int32")))
    assert np.abs(_logits(theirs, ids) - ours).max() <= TOL
    back, _ = huggingface.load_gpt(tmp_path / "out")
    assert np.abs(np.asarray(back(ids.astype("int32"))) - ours).max() <= TOL


def _fine_tune_overrides(checkpoints, data_dir, **extra):
    return ["--config.init_from=hf:" + checkpoints["llama"],
            "--config.data.source=" + checkpoints["corpus"],
            f"--config.data.data_dir={data_dir}", "--config.model.block_size=32",
            "--config.train.steps=20", "--config.train.steps_per_epoch=10",
            "--config.train.warmup_steps=2", "--config.train.batch_size=8",
            "--config.train.learning_rate=3e-3", "--config.backup.enabled=false",
            *[f"--config.{k}={v}" for k, v in extra.items()]]


@pytest.fixture(scope="module")
def fine_tuned(checkpoints, tmp_path_factory):
    """`tfdist prepare`, then `tfdist train`, from the llama checkpoint: the run's workdir."""
    root = tmp_path_factory.mktemp("fine-tune")
    p = tfdist("prepare", *_fine_tune_overrides(checkpoints, root / "data"))
    assert "tokenizer.json (300 tokens)" in p.stdout  # the checkpoint's tokenizer
    p = tfdist("train", *_fine_tune_overrides(checkpoints, root / "data"),
               f"--workdir={root / 'run'}")
    assert "weights from the Hugging Face checkpoint" in p.stdout
    return root


@pytest.fixture(scope="module")
def first_loss(checkpoints, fine_tuned):
    """transformers' loss on the run's first batch (the store it prepared, its step-0 windows)."""
    import ml_collections

    from tfdist.data import Windows
    from tfdist.data.build import open_store

    data = ml_collections.ConfigDict({"source": checkpoints["corpus"],
                                      "data_dir": str(fine_tuned / "data"),
                                      "tokenizer": os.path.join(checkpoints["llama"],
                                                                "tokenizer.json"),
                                      "vocab_size": 0, "shard_tokens": 1 << 17,
                                      "text_key": "text", "val_fraction": 0.05})
    x, y = Windows(open_store(data, progress=False).split("train"), 32, 8, seed=1337).batch(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    logits = torch.tensor(_logits(model, np.asarray(x)))
    return float(torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), torch.tensor(np.asarray(y)).long().reshape(-1)))


@pytest.mark.slow
def test_fine_tuning_starts_at_transformers_loss_and_lowers_it(fine_tuned, first_loss):
    """`tfdist train --config.init_from=hf:DIR` on a corpus tokenized by the checkpoint's
    tokenizer.json: its first step's loss (before any update) equals transformers' loss on the
    same batch within 1e-4, and the loss falls."""
    steps = metrics(fine_tuned / "run")["steps"]
    assert abs(steps[0]["loss"] - first_loss) <= 1e-4, (steps[0]["loss"], first_loss)
    first, last = np.mean([s["loss"] for s in steps[:3]]), np.mean([s["loss"] for s in steps[-3:]])
    assert last < first - 0.05, (first, last)


@pytest.mark.slow
@pytest.mark.horovod
def test_fine_tuning_under_horovod_zero3_loads_each_ranks_shards(checkpoints, fine_tuned,
                                                                  tmp_path):
    """2 Horovod ranks with ZeRO-3, each loading only the weights it owns: the single run's
    losses (within 1e-5) from the first step on."""
    overrides = {"init_from": "hf:" + checkpoints["llama"], "data.source": checkpoints["corpus"],
                 "data.data_dir": str(fine_tuned / "data"), "model.block_size": 32,
                 "train.steps": 20, "train.steps_per_epoch": 10, "train.warmup_steps": 2,
                 "train.batch_size": 8, "train.learning_rate": 3e-3, "backup.enabled": False,
                 "strategy.name": "horovod", "zero.stage": 3}
    p = driver_group(tmp_path, overrides, ranks=2)
    assert "ZeRO-3 over 2 replica(s)" in p.stdout
    a, b = losses(fine_tuned / "run"), losses(tmp_path)
    assert len(a) == len(b) == 20
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)


@pytest.mark.slow
def test_export_and_sample_commands_round_trip_a_fine_tuned_run(fine_tuned, tmp_path):
    """`tfdist export --format=hf` of the run: transformers loads it with the logits of the
    run's model.keras, with its tokenizer.json; `tfdist sample --model=hf:` samples from it."""
    import keras

    out = tmp_path / "export"
    p = tfdist("export", f"--model={fine_tuned / 'run' / 'model.keras'}", "--format=hf",
               f"--out={out}")
    assert "LlamaForCausalLM" in p.stdout
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    ours = keras.saving.load_model(fine_tuned / "run" / "model.keras", compile=False)
    ids = np.random.RandomState(3).randint(0, VOCAB, (2, 16))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert np.abs(_logits(theirs, ids) - np.asarray(ours(ids.astype("int32")))).max() <= TOL
    p = tfdist("sample", f"--model=hf:{out}", "--prompt=def ", "--top_k=1",
               "--max_new_tokens=8")
    assert p.stdout.splitlines()[1].startswith("def ")


def test_sampling_a_checkpoint_by_token_ids_is_transformers_greedy_decoding(checkpoints):
    """`tfdist sample --model=hf:DIR --prompt_ids=... --top_k=1` (no tokenizer needed): the ids
    transformers' greedy `generate` gives."""
    p = tfdist("sample", f"--model=hf:{checkpoints['gpt2']}", "--prompt_ids=5,17,42",
               "--top_k=1", "--max_new_tokens=12")
    ours = [int(t) for t in p.stdout.splitlines()[1].split(",")]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["gpt2"]).eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=12,
                                do_sample=False, pad_token_id=0)[0].tolist()
    assert ours == theirs


# -- bad input: one line, exit 2 ------------------------------------------------------------------

def _broken(checkpoints, tmp_path, arch, **config):
    """A copy of a checkpoint with config.json's keys changed."""
    directory = tmp_path / f"broken-{arch}"
    shutil.copytree(checkpoints[arch], directory)
    with open(directory / "config.json") as f:
        c = json.load(f)
    c.update(config)
    with open(directory / "config.json", "w") as f:
        json.dump(c, f)
    return str(directory)


def test_config_variants_read_as_transformers_writes_them(checkpoints, tmp_path):
    """transformers 4's Llama config (top-level rope_theta, rope_scaling with `type`), one
    without num_key_value_heads (multi-head) or architectures (model_type), and configs with a
    key missing or a GPT-2 option tfdist lacks: read, or refused in one line naming the key."""
    from tfdist.errors import UsageError
    from tfdist.models import huggingface

    old = _broken(checkpoints, tmp_path, "llama", rope_parameters=None, rope_theta=250000.0,
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16})
    m = huggingface.Checkpoint(old).model_config()
    assert (m["rope_theta"], m["rope_scaling_factor"], m["rope_original_context"]) == (
        250000.0, 8.0, 16)
    shutil.rmtree(old)
    c = json.load(open(os.path.join(checkpoints["llama"], "config.json")))
    del c["num_key_value_heads"], c["architectures"]
    plain = _broken(checkpoints, tmp_path, "llama")
    json.dump(c, open(os.path.join(plain, "config.json"), "w"))
    m = huggingface.Checkpoint(plain).model_config()
    assert m["arch"] == "llama" and m["n_kv_head"] == m["n_head"] == 4
    shutil.rmtree(plain)
    del c["intermediate_size"]
    json.dump(c, open(os.path.join(_broken(checkpoints, tmp_path, "llama"), "config.json"), "w"))
    with pytest.raises(UsageError, match="config.json has no 'intermediate_size'"):
        huggingface.Checkpoint(tmp_path / "broken-llama").model_config()
    gpt2 = _broken(checkpoints, tmp_path, "gpt2", scale_attn_weights=False)
    with pytest.raises(UsageError, match="scale_attn_weights=false is not in tfdist's GPT-2"):
        huggingface.Checkpoint(gpt2).model_config()


@pytest.mark.parametrize("case", first_fast(["no_config", "architecture", "shape", "tokenizer",
                                             "train_tokenizer", "heads", "mlp_width"]))
def test_bad_checkpoints_and_layouts_are_one_line(checkpoints, tmp_path, case):
    sample = ["sample", "--max_new_tokens=2"]
    if case == "no_config":
        (tmp_path / "empty").mkdir()
        p = tfdist(*sample, f"--model=hf:{tmp_path / 'empty'}", "--prompt_ids=1", check=False)
        assert_usage_error(p, "has no config.json")
    elif case == "architecture":
        d = _broken(checkpoints, tmp_path, "llama", architectures=["MistralForCausalLM"])
        p = tfdist(*sample, f"--model=hf:{d}", "--prompt_ids=1", check=False)
        assert_usage_error(p, "tfdist reads GPT2LMHeadModel and LlamaForCausalLM checkpoints")
    elif case == "shape":
        d = _broken(checkpoints, tmp_path, "llama", intermediate_size=64)
        p = tfdist(*sample, f"--model=hf:{d}", "--prompt_ids=1", check=False)
        assert_usage_error(p, "model.layers.0.mlp.gate_proj.weight + "
                              "model.layers.0.mlp.up_proj.weight makes a tensor of shape")
    elif case == "tokenizer":  # the GPT-2 checkpoint has none
        p = tfdist(*sample, f"--model=hf:{checkpoints['gpt2']}", "--prompt=hi", check=False)
        assert_usage_error(p, "has no tokenizer.json to encode --prompt")
    elif case == "train_tokenizer":
        p = tfdist("train", f"--config.init_from=hf:{checkpoints['gpt2']}",
                   "--config.model.block_size=32", f"--workdir={tmp_path / 'run'}", check=False)
        assert_usage_error(p, "has no tokenizer.json; give its tokenizer in data.tokenizer")
    elif case == "heads":  # 2 key/value heads cannot be split over 4 devices
        p = tfdist("train", *_fine_tune_overrides(checkpoints, tmp_path / "data",
                                                  **{"tensor.parallel": 4}),
                   f"--workdir={tmp_path / 'run'}", check=False)
        assert_usage_error(p, "tensor.parallel=4 must divide model.n_kv_head (2)")
    else:  # a SwiGLU 51 wide cannot be split over 2 devices (refused before any weight)
        d = _broken(checkpoints, tmp_path, "llama", intermediate_size=51)
        p = tfdist("train", *_fine_tune_overrides(checkpoints, tmp_path / "data",
                                                  **{"tensor.parallel": 2}),
                   "--config.init_from=hf:" + d, f"--workdir={tmp_path / 'run'}", check=False)
        assert_usage_error(p, "tensor.parallel=2 must divide the MLP's width "
                              "(model.ffn_hidden 51)")
    assert not (tmp_path / "run").exists()  # nothing written


def test_under_zero3_each_replica_reads_only_the_tensors_it_owns(checkpoints):
    """A Llama sharded over 2 replicas (ZeRO-3): loading on replica r reads from the checkpoint
    only the tensors whose variables r owns, and between the two every tensor is read once and
    every variable is filled with it."""
    from tfdist import compat
    from tfdist.models import huggingface, state
    from tfdist.models.gpt import GPT
    from tfdist.parallel import zero

    checkpoint = huggingface.Checkpoint(checkpoints["llama"])
    read = {0: [], 1: []}
    for rank in (0, 1):
        gpt = GPT.from_model_config(checkpoint.model_config())
        gpt.build()
        zero.make(3, gpt, zero.Collectives(rank, 2, None, None, None, None))
        tensor = checkpoint.tensor
        checkpoint.tensor = lambda name, r=rank, t=tensor: read[r].append(name) or t(name)
        huggingface.load_weights(gpt, checkpoint)
        del checkpoint.tensor
        owned = {n: v for n, v in state.weights(gpt).items() if compat.has_storage(v)}
        assert owned and len(owned) < len(state.weights(gpt))
        # every owned variable holds the checkpoint's tensor (not its random initialisation)
        plain, _ = huggingface.load_gpt(checkpoints["llama"])
        expected = state.weights(plain)
        for name, v in owned.items():
            assert np.array_equal(np.asarray(v), np.asarray(expected[name])), name
    assert not set(read[0]) & set(read[1])
    assert sorted(read[0] + read[1]) == checkpoint.tensor_names()
