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

from tests.helpers import ROOT, assert_usage_error, first_fast, metrics, run, tfdist

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


def _fine_tune_overrides(checkpoints, tmp_path, **extra):
    return ["--config.init_from=hf:" + checkpoints["llama"],
            "--config.data.source=" + checkpoints["corpus"],
            f"--config.data.data_dir={tmp_path / 'data'}", "--config.model.block_size=32",
            "--config.train.steps=20", "--config.train.steps_per_epoch=10",
            "--config.train.warmup_steps=2", "--config.train.batch_size=8",
            "--config.train.learning_rate=3e-3", "--config.backup.enabled=false",
            *[f"--config.{k}={v}" for k, v in extra.items()]]


@pytest.mark.slow
def test_fine_tuning_starts_at_transformers_loss_and_lowers_it(checkpoints, tmp_path):
    """`tfdist train --config.init_from=hf:DIR` on a corpus tokenized by the checkpoint's
    tokenizer.json: its first step's loss (before any update) equals transformers' loss on the
    same batch within 1e-4, and the loss falls."""
    import ml_collections

    from tfdist.data import Windows
    from tfdist.data.build import open_store

    p = tfdist("train", *_fine_tune_overrides(checkpoints, tmp_path),
               f"--workdir={tmp_path / 'run'}")
    assert "weights from the Hugging Face checkpoint" in p.stdout
    steps = metrics(tmp_path / "run")["steps"]
    # the same batch: the store the run prepared, its step-0 windows
    data = ml_collections.ConfigDict({"source": checkpoints["corpus"],
                                      "data_dir": str(tmp_path / "data"),
                                      "tokenizer": os.path.join(checkpoints["llama"],
                                                                "tokenizer.json"),
                                      "vocab_size": 0, "shard_tokens": 1 << 17,
                                      "text_key": "text", "val_fraction": 0.05})
    x, y = Windows(open_store(data, progress=False).split("train"), 32, 8, seed=1337).batch(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"]).eval()
    logits = torch.tensor(_logits(model, np.asarray(x)))
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                               torch.tensor(np.asarray(y)).long().reshape(-1))
    assert abs(steps[0]["loss"] - float(theirs)) <= 1e-4, (steps[0]["loss"], float(theirs))
    first, last = np.mean([s["loss"] for s in steps[:3]]), np.mean([s["loss"] for s in steps[-3:]])
    assert last < first - 0.05, (first, last)


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


@pytest.mark.parametrize("case", first_fast(["no_config", "architecture", "shape", "tokenizer",
                                             "train_tokenizer", "heads"]))
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
    else:  # 2 key/value heads cannot be split over 4 devices
        p = tfdist("train", *_fine_tune_overrides(checkpoints, tmp_path,
                                                  **{"tensor.parallel": 4}),
                   f"--workdir={tmp_path / 'run'}", check=False)
        assert_usage_error(p, "tensor.parallel=4 must divide model.n_kv_head (2)")
    assert not (tmp_path / "run").exists()  # nothing written
