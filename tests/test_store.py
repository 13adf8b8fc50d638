"""The token store end to end through the CLI: prepare survives kills, nanoGPT's files train
unchanged, memory does not grow with the corpus, and bad data is one line with exit 2."""
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import (
    ROOT,
    assert_usage_error,
    metrics,
    run,
    tfdist,
    tree_digest,
    wait_until,
    write_nanogpt,
)
from tfdist.data import ByteTokenizer

BYTES = ByteTokenizer.vocab_size  # the byte tokenizer's vocabulary

NANO = ["--config.train.steps=4", "--config.train.steps_per_epoch=2",
        "--config.train.warmup_steps=1", "--config.train.eval_steps=2"]


def store_of(tmp_path, name, n_train, seed=0, **kw):
    """A byte store of `n_train` random tokens (uint16 shards), written directly."""
    from tfdist.data import store
    rng = np.random.default_rng(seed)
    return store.from_arrays(str(tmp_path / name), train=rng.integers(0, BYTES, n_train, np.uint8),
                             val=rng.integers(0, BYTES, 100_000, np.uint8), **kw)


def one_line_exit_2(p, expected):
    assert_usage_error(p, expected)
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_bad_data_is_one_line_and_exit_2_with_nothing_touched(tmp_path, data_dir):
    from tfdist.data import store
    good = store_of(tmp_path, "good", 50_000).dir
    bad = {}
    for name in ("no-manifest", "corrupt-manifest", "truncated-shard"):
        bad[name] = store_of(tmp_path, name, 50_000, shard_tokens=16_384).dir
    os.remove(os.path.join(bad["no-manifest"], store.MANIFEST))
    with open(os.path.join(bad["corrupt-manifest"], store.MANIFEST), "w") as f:
        f.write('{"format": "tfdist-token-store", "vers')
    truncated = 1000  # bytes left of the second shard
    shard = store.shard_path(bad["truncated-shard"], "train", 1)
    with open(shard, "r+b") as f:
        f.truncate(truncated)
    write_nanogpt(tmp_path / "odd", n_train=1000, n_val=100)
    with open(tmp_path / "odd" / "train.bin", "ab") as f:
        f.write(b"\0")  # half a token
    gpt2_vocab, stated_vocab = 50257, 1000
    write_nanogpt(tmp_path / "big-ids", n_train=1000, n_val=100, vocab=gpt2_vocab)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello world\n" * 2000)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a store")
    wd = tmp_path / "wd"
    train = ["train", f"--workdir={wd}", f"--config.data.data_dir={tmp_path / 'dd'}"]
    cases = [
        (train + [f"--config.data.source=store:{bad['no-manifest']}"],
         "not a prepared token store"),
        (train + [f"--config.data.source=store:{bad['corrupt-manifest']}"], "manifest"),
        (train + [f"--config.data.source=store:{bad['truncated-shard']}"],
         f"{os.path.basename(shard)} is {truncated:,} bytes"),
        (train + [f"--config.data.source=store:{good}", "--config.model.vocab_size=100"],
         f"smaller than the tokenizer's vocabulary ({BYTES}"),
        (train + ["--config.data.tokenizer=/no/such/vocab.json"],
         "tokenizer file '/no/such/vocab.json' not found"),
        (train + ["--config.data.source=hdfs:corpus"], "unknown data source scheme 'hdfs:'"),
        (["prepare", f"--out={good}", f"--config.data.source={tmp_path / 'text'}"],
         "holds the token store of another corpus"),
        (["prepare", f"--out={tmp_path / 'other'}", f"--config.data.source={tmp_path / 'text'}"],
         "is not empty and holds no token store"),
        (train + [f"--config.data.source=nanogpt:{tmp_path / 'odd'}",
                  f"--config.data.vocab_size={gpt2_vocab}"], "not a whole number of uint16 tokens"),
        (train + [f"--config.data.source=nanogpt:{tmp_path / 'big-ids'}",
                  f"--config.data.vocab_size={stated_vocab}"],
         f"not below the stated vocabulary size {stated_vocab}"),
        (train + [f"--config.data.source=nanogpt:{tmp_path / 'big-ids'}"],
         "needs its vocabulary size"),
        (train + [f"--config.data.source={tmp_path / 'text'}", "--config.data.tokenizer=bpe",
                  "--config.data.vocab_size=100"],
         f"at least {BYTES + 1}"),  # the bytes and end-of-text
    ]
    before = tree_digest(str(tmp_path))
    for args, expected in cases:
        one_line_exit_2(tfdist(*args, check=False, timeout=120), expected)
        assert tree_digest(str(tmp_path)) == before, args  # nothing written, nothing removed


def prepare_cmd(out, corpus):
    return [sys.executable, "-m", "tfdist", "prepare", f"--out={out}",
            f"--config.data.source={corpus}", "--config.data.tokenizer=bpe",
            "--config.data.vocab_size=2048", "--workers=2"]


def fingerprint(p):
    return [x for x in p.stdout.splitlines() if "fingerprint" in x][-1].split()[-1]


@pytest.mark.slow
def test_a_killed_prepare_finishes_on_rerun_with_the_same_store(tmp_path):
    """SIGKILL the prepare (with its tokenizer processes) at 2 random points of its progress; each
    rerun goes on, and the finished store has the fingerprint of an uninterrupted prepare."""
    from tfdist.data import sources, store
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    words = [w for w in open(sources.stdlib_files()[0]).read().split() if w.isidentifier()] or ["x"]
    for i in range(4):  # ~3 MB of text in 4 files: a work unit or more each
        lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(15_000)]
        (corpus / f"part{i:02d}.txt").write_text("\n".join(lines) + "\n")
    ref = run(prepare_cmd(tmp_path / "ref", corpus), timeout=600, check=False)
    assert ref.returncode == 0, ref.stderr[-3000:]
    units = int(re.search(r"MB, (\d+) units", ref.stdout).group(1))
    # The kill points: once a random number of units are done (-1: as soon as the prepare has
    # started, while the BPE trains), at most units - 2, so that every run is killed with work left.
    points = sorted(rng.sample(range(-1, units - 1), 2))
    out = tmp_path / "store"
    for point in points:
        p = subprocess.Popen(prepare_cmd(out, corpus), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True)
        # units: <split>-<k>.json
        wait_until(lambda point=point: os.path.exists(out / ".work" / "key") and
                   len(glob.glob(str(out / ".work" / "*-*.json"))) >= point, 300,
                   f"{point} finished units", proc=p,
                   describe=lambda p=p: p.communicate()[1][-2000:] if p.poll() is not None else "")
        os.killpg(p.pid, signal.SIGKILL)  # the prepare and the tokenizer processes it started
        p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL, point
        assert store.read_manifest(str(out)) is None  # an unfinished store is never complete
    done = run(prepare_cmd(out, corpus), timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done before" in done.stdout
    assert fingerprint(done) == fingerprint(ref)
    assert not os.path.exists(out / ".work")
    for name in ("train", "val"):  # the same shards, byte for byte
        for f in sorted(os.listdir(tmp_path / "ref" / name)):
            assert (open(out / name / f, "rb").read()
                    == open(tmp_path / "ref" / name / f, "rb").read())


@pytest.mark.slow
def test_nanogpt_bins_train_unchanged(tmp_path):
    n_train, n_val, vocab = 100_000, 10_000, 50257
    ids = write_nanogpt(tmp_path / "owt", n_train=n_train, n_val=n_val, vocab=vocab)
    before = tree_digest(str(tmp_path / "owt"))
    wd = tmp_path / "run"
    p = tfdist("train", f"--workdir={wd}", f"--config.data.data_dir={tmp_path / 'dd'}",
               f"--config.data.source=nanogpt:{tmp_path / 'owt'}",
               f"--config.data.vocab_size={vocab}", *NANO)
    assert f"{n_train:,} train / {n_val:,} validation tokens" in p.stdout
    assert "bits/byte unknown" in p.stdout  # ids only: the text's size is not known
    m = metrics(wd)
    assert abs(m["evals"][-1]["loss"] - np.log(vocab)) < 1.0  # random ids: about ln(vocab)
    assert tree_digest(str(tmp_path / "owt")) == before
    assert ids["train"].max() < vocab


def peak_rss(p):
    line = [x for x in p.stdout.splitlines() if x.startswith("tfdist: done:")][-1]
    return float(line.split("peak RSS ")[1].split(" MiB")[0].replace(",", ""))


@pytest.mark.slow
def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """gpt_nano from a 30 MB and a 300 MB store: the same peak RSS (a corpus in memory, or as a
    graph constant, adds at least its size)."""
    from tfdist.data import store
    token_bytes = np.dtype(store.dtype_for(BYTES)).itemsize  # the store's bytes a token (uint16)
    rss = {}
    for mb in (30, 300):
        s = store_of(tmp_path, f"s{mb}", mb * (1 << 20) // token_bytes, seed=mb)
        # fresh: a process of its own: a fork's resident set starts with the server's
        p = tfdist("train", f"--workdir={tmp_path / f'run{mb}'}",
                   f"--config.data.source=store:{s.dir}",
                   "--config.train.steps=10", "--config.train.steps_per_epoch=10",
                   "--config.train.warmup_steps=1", "--config.train.eval_steps=2", timeout=300,
                   fresh=True)
        rss[mb] = peak_rss(p)
    assert abs(rss[300] - rss[30]) < 60, rss


@pytest.mark.slow
def test_a_bpe_run_follows_its_vocabulary_and_samples_text(tmp_path):
    """model.vocab_size follows the trained BPE; the tokenizer is saved with the run, and
    `tfdist sample` decodes with it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(3000)))
    wd, vocab = tmp_path / "run", 300
    p = tfdist("train", f"--workdir={wd}", f"--config.data.data_dir={tmp_path / 'dd'}",
               f"--config.data.source={corpus}", "--config.data.tokenizer=bpe",
               f"--config.data.vocab_size={vocab}", *NANO)
    assert f"bpe ({vocab} tokens)" in p.stdout and "bits/byte)" in p.stdout
    config = json.load(open(wd / "tokenizer" / "config.json"))
    assert config["kind"] == "bpe" and config["vocab_size"] == vocab
    m = metrics(wd)
    assert m["evals"][-1]["bits_per_byte"] > 0
    s = tfdist("sample", f"--model={wd}/model.keras", "--prompt=def function_",
               "--max_new_tokens=20")
    text = s.stdout.split("---\n", 1)[1]
    assert text.startswith("def function_") and len(text) > len("def function_") + 5
