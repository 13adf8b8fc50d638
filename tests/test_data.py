"""Data: tokenizers, sources, the token store and its reader, deterministic / resumable / sharded
windows."""
import io
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tests.helpers import write_nanogpt
from tfdist import config
from tfdist.data import ByteTokenizer, Windows, build, open_store, sources, store, tokenizer
from tfdist.errors import UsageError

BYTES = ByteTokenizer.vocab_size  # the byte tokenizer's vocabulary
VAL_FRACTION = config.default_config().data.val_fraction  # validation tail of a corpus


def data_config(tmp_path, **kw):
    c = config.default_config()
    c.data.data_dir = str(tmp_path / "data")
    c.data.update(kw)
    return c.data


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    with pytest.raises(ValueError):
        tok.decode([300])


def test_default_corpus_is_the_stdlib_as_a_token_store(data_dir):
    c = config.default_config()
    c.data.data_dir = data_dir
    s = open_store(c.data, progress=False)
    train, val = s.manifest["splits"]["train"], s.manifest["splits"]["val"]
    assert s.manifest["source"] == "stdlib" and s.dtype == "uint16" and s.vocab_size == BYTES
    assert train["tokens"] > 5_000_000  # ~12 MB of Python on 3.11
    assert abs(val["tokens"] / (train["tokens"] + val["tokens"]) - c.data.val_fraction) < 0.01
    assert train["bytes"] == train["tokens"]  # bytes: one token per byte, newline separators
    assert train["documents"] + val["documents"] == sum(os.path.getsize(f) > 0
                                                        for f in sources.stdlib_files())
    # the shards hold the files' bytes: the first file's text starts the train split
    first = open(sources.stdlib_files()[0], "rb").read()
    x = s.split("train").windows([0], min(len(first), 500)).numpy()[0]
    assert bytes(x.astype(np.uint8)) == first[:len(x)]


def test_user_text_files_and_directories(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("alpha\n" * 500)
    (d / "b.md").write_text("beta\n" * 500)
    (d / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    one = tmp_path / "c.txt"
    one.write_text("gamma\n" * 500)
    s = open_store(data_config(tmp_path, source=f"{d},{one}"), progress=False)
    text = "".join(bytes(s.split(n).windows([0], s.split(n).num_tokens).numpy()[0].astype(np.uint8)
                           ).decode() for n in ("train", "val"))
    # each file is a document followed by a newline; validation is the tail, at a line start
    assert text == "alpha\n" * 500 + "\n" + "beta\n" * 500 + "\n" + "gamma\n" * 500 + "\n"
    assert abs(s.split("val").num_tokens / len(text) - VAL_FRACTION) < 0.005


def test_unit_boundaries_fall_on_lines_and_lose_nothing(tmp_path, monkeypatch):
    """A big file is cut into units at line starts: the units' text is the file, exactly once."""
    monkeypatch.setattr(sources, "UNIT_BYTES", 1000)
    lines = [f"line {i} " + "x" * (i % 97) + "\n" for i in range(2000)]
    (tmp_path / "big.txt").write_text("".join(lines))
    src = sources.resolve(data_config(tmp_path, source=str(tmp_path / "big.txt")))
    assert len(src.units["train"]) > 50
    parts = [t for split in ("train", "val") for u in src.units[split]
             for t, _, _ in sources.read_unit(u)]
    assert "".join(parts) == "".join(lines)
    assert all(p.endswith("\n") for p in parts)


def test_missing_path_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        open_store(data_config(tmp_path, source=str(tmp_path / "nope")))
    with pytest.raises(UsageError, match="unknown data source scheme 'hdfs:'"):
        open_store(data_config(tmp_path, source="hdfs:corpus"))


class TinyCorpus(tfds.core.GeneratorBasedBuilder):
    """A stand-in for a TFDS dataset prepared elsewhere (train and validation splits)."""
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"content": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples("train " * 300),
                "validation": self._generate_examples("valid " * 100)}

    def _generate_examples(self, text):
        for i in range(3):
            yield i, {"content": f"{i}:{text}"}


def test_prepared_tfds_dataset_uses_its_validation_split(tmp_path):
    TinyCorpus(data_dir=str(tmp_path / "data")).download_and_prepare()
    c = data_config(tmp_path, source="tfds:tiny_corpus", text_key="content")
    s = open_store(c, progress=False)
    read = {n: bytes(s.split(n).windows([0], s.split(n).num_tokens).numpy()[0].astype(np.uint8))
            for n in ("train", "val")}
    assert b"train" in read["train"] and b"train" not in read["val"] and b"valid" in read["val"]
    assert s.manifest["splits"]["train"]["documents"] == 3
    c.text_key = "text"
    with pytest.raises(UsageError, match="no feature 'text'"):
        open_store(c)
    c.source = "tfds:no_such_dataset_xyz"
    with pytest.raises(UsageError, match="not found"):
        open_store(c)


# -- the store and its reader ------------------------------------------------------------------
TOKENS = np.frombuffer(bytes(range(BYTES)) * 200, np.uint8)  # every id in turn
BLOCK, BATCH = 16, 8  # of the windows read from it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A byte store of TOKENS in 4 Ki-token shards (so windows cross shard boundaries)."""
    return store.from_arrays(str(tmp_path_factory.mktemp("tiny")), train=TOKENS, val=TOKENS[:3000],
                             shard_tokens=4096)


@pytest.mark.parametrize("vocab", [256, 50257, 100_000])
def test_windows_read_the_ids_at_their_offsets_across_shards(tmp_path, vocab):
    n, shard, window = 30_000, 1024, 65
    ids = (np.arange(n, dtype=np.int64) * 7919) % vocab
    s = store.from_arrays(str(tmp_path), train=ids, val=ids[:2000], vocab_size=vocab,
                          shard_tokens=shard)
    assert s.dtype == ("uint16" if vocab <= 1 << 16 else "uint32")  # the smallest that holds them
    assert s.manifest["splits"]["train"]["shards"] == math.ceil(n / shard)
    # from the start, inside the first shard, ending at / starting at / crossing its end, the last
    offsets = [0, 1000, shard - 1, shard, 2 * shard - 8, n - window]
    got = s.split("train").windows(offsets, window).numpy()
    np.testing.assert_array_equal(got, np.stack([ids[o:o + window] for o in offsets]))


def test_no_token_is_embedded_in_the_graph(tiny):
    """The batch function's graph holds paths, not the corpus: its size does not grow with it."""
    w = Windows(tiny.split("train"), block_size=BLOCK, global_batch=BATCH, seed=0)
    graph = tf.function(w.batch).get_concrete_function(
        tf.constant(3, tf.int64)).graph.as_graph_def()
    consts = [n for n in graph.node if n.op == "Const"]
    assert max(len(n.attr["value"].tensor.tensor_content) for n in consts) < 1000
    assert graph.ByteSize() < 100_000


def _batches(ds, n):
    return [(x.numpy(), y.numpy()) for x, y in ds.take(n)]


def test_windows_are_targets_shifted_and_deterministic(tiny):
    w = Windows(tiny.split("train"), block_size=BLOCK, global_batch=BATCH, seed=5)
    a = _batches(w.dataset_fn(0, 5)(None), 5)
    b = _batches(Windows(tiny.split("train"), BLOCK, BATCH, seed=5).dataset_fn(0, 5)(None), 5)
    for (x, y), (x2, _) in zip(a, b):
        assert x.shape == (BATCH, BLOCK) and x.dtype == np.int32
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
        np.testing.assert_array_equal((x[:, 0] + 1) % BYTES, y[:, 0])  # TOKENS: the next id
        np.testing.assert_array_equal(x, x2)
    other = _batches(Windows(tiny.split("train"), BLOCK, BATCH, seed=6).dataset_fn(0, 1)(None), 1)
    assert not np.array_equal(other[0][0], a[0][0])


def test_resume_at_step_reads_exactly_the_remaining_batches(tiny):
    w = Windows(tiny.split("train"), block_size=BLOCK, global_batch=BATCH, seed=1)
    steps, resume = 10, 6
    full = _batches(w.dataset_fn(0, steps)(None), steps)
    tail = _batches(w.dataset_fn(resume, steps - resume)(None), steps)
    assert len(tail) == steps - resume
    for (x, _), (x2, _) in zip(full[resume:], tail):
        np.testing.assert_array_equal(x, x2)


@pytest.mark.parametrize("pipelines,replicas", [(1, 2), (2, 2), (2, 4), (1, 4)])
def test_shards_across_replicas_make_up_the_global_batch(tiny, pipelines, replicas):
    """One global step's rows across all replicas are the single-replica global batch, no dups."""
    w = Windows(tiny.split("train"), block_size=BLOCK, global_batch=BATCH, seed=2)
    whole = _batches(w.dataset_fn(3, 2)(None), 2)
    local = replicas // pipelines
    for step in range(2):
        rows = []
        for p in range(pipelines):
            ctx = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=p,
                                             num_replicas_in_sync=replicas)
            per = _batches(w.dataset_fn(3, 2)(ctx), 2 * local)
            assert all(x.shape == (BATCH // replicas, BLOCK) for x, _ in per)
            rows += [x for x, _ in per[step * local:(step + 1) * local]]
        np.testing.assert_array_equal(np.concatenate(rows), whole[step][0])
        assert len({r.tobytes() for r in np.concatenate(rows)}) == BATCH


def test_too_short_corpus_is_refused(tmp_path):
    s = store.from_arrays(str(tmp_path), train=np.zeros(10, np.uint8), val=np.zeros(10, np.uint8))
    with pytest.raises(UsageError, match="shorter than one window"):
        Windows(s.split("train"), block_size=BLOCK, global_batch=2, seed=0)


def test_stdlib_file_list_skips_tests_and_site_packages():
    files = sources.stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any(os.sep + "test" + os.sep in f or "site-packages" in f for f in files)


# -- nanoGPT's format --------------------------------------------------------------------------
def test_nanogpt_batches_are_the_windows_of_the_bin_file(tmp_path):
    n_train, vocab, block = 200_000, 50257, 64
    write_nanogpt(tmp_path / "owt", n_train=n_train, vocab=vocab)
    c = data_config(tmp_path, source=f"nanogpt:{tmp_path / 'owt'}", vocab_size=vocab)
    s = open_store(c)
    assert s.vocab_size == vocab and s.manifest["splits"]["train"]["tokens"] == n_train
    data = np.memmap(tmp_path / "owt" / "train.bin", dtype=np.uint16, mode="r")  # nanoGPT's read
    w = Windows(s.split("train"), block_size=block, global_batch=BATCH, seed=3)
    for step, (x, y) in enumerate(w.dataset_fn(0, 3)(None)):
        rows = w.offsets(step).numpy()
        np.testing.assert_array_equal(x.numpy(), np.stack([data[o:o + block] for o in rows]))
        np.testing.assert_array_equal(y.numpy(),
                                      np.stack([data[o + 1:o + block + 1] for o in rows]))
    assert open_store(c).fingerprint == s.fingerprint  # found again, not re-imported


# -- tokenizers --------------------------------------------------------------------------------
SAMPLE = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "héllo wörld ✓ 日本\n\n\t  x"]


def test_bpe_round_trips_and_its_gpt2_files_load_identically(tmp_path):
    vocab = 400
    bpe = tokenizer.train_bpe(SAMPLE * 50, vocab_size=vocab)
    assert bpe.vocab_size <= vocab and bpe.eot is not None
    for text in SAMPLE + ["unseen: ∑ 🙂 \r\n  "]:
        assert bpe.decode(bpe.encode(text)) == text
    bpe.tok.model.save(str(tmp_path))  # GPT-2's format: vocab.json + merges.txt (#version line)
    assert (tmp_path / "vocab.json").exists() and (tmp_path / "merges.txt").exists()
    gpt2 = tokenizer.from_file(str(tmp_path / "vocab.json"))
    assert gpt2.kind == "gpt2"
    for text in SAMPLE:
        np.testing.assert_array_equal(gpt2.encode(text), bpe.encode(text))
        assert gpt2.decode(gpt2.encode(text)) == text
    saved = gpt2.save(str(tmp_path))
    again = tokenizer.load(str(tmp_path), saved)
    np.testing.assert_array_equal(again.encode(SAMPLE[0]), gpt2.encode(SAMPLE[0]))


def test_sentencepiece_model_loads_and_round_trips(tmp_path):
    import sentencepiece as spm
    model, vocab = io.BytesIO(), 320
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SAMPLE * 30), model_writer=model,
                                   vocab_size=vocab, model_type="bpe", byte_fallback=True,
                                   normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2)
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    sp = tokenizer.from_file(str(tmp_path / "sp.model"))
    assert sp.kind == "sentencepiece" and sp.vocab_size == vocab
    for text in ["def f(x):", "return x + 1", "héllo wörld"]:
        assert sp.decode(sp.encode(text)) == text
    again = tokenizer.load(str(tmp_path), sp.save(str(tmp_path)))
    np.testing.assert_array_equal(again.encode("class A"), sp.encode("class A"))


def test_bad_tokenizer_files_are_one_line_errors(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        tokenizer.from_file(str(tmp_path / "nope.json"))
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0}))
    with pytest.raises(UsageError, match="no merges.txt"):
        tokenizer.from_file(str(tmp_path / "vocab.json"))
    (tmp_path / "x.model").write_bytes(b"not a model")
    with pytest.raises(UsageError, match="cannot load tokenizer"):
        tokenizer.from_file(str(tmp_path / "x.model"))


def _bpe_config():
    c = config.default_config()
    c.data.tokenizer = "bpe"
    return c


BPE_VOCAB = config.vocab_size(_bpe_config())  # a BPE's tokens when data.vocab_size is 0: 8,192


@pytest.fixture(scope="module")
def stdlib_bpe(tmp_path_factory):
    """The stdlib prepared with a BPE of 8,192 tokens (as `tfdist prepare` does)."""
    c = _bpe_config()
    c.data.data_dir = str(tmp_path_factory.mktemp("bpe"))
    c.data.vocab_size = BPE_VOCAB
    return build.build_store(c.data, progress=False)


@pytest.mark.slow
@pytest.mark.long  # time (~1 min): the small BPE round trip above stays in make test
def test_bpe_8192_on_the_stdlib_round_trips_every_file(stdlib_bpe):
    tok = stdlib_bpe.tokenizer()
    assert tok.vocab_size == BPE_VOCAB and stdlib_bpe.vocab_size == BPE_VOCAB
    train = stdlib_bpe.manifest["splits"]["train"]
    assert 2.5 < train["bytes"] / train["tokens"] < 6  # bytes per token: well above the byte's 1
    files = sources.stdlib_files()
    texts = [open(f, "rb").read().decode("utf-8") for f in files]
    for f, text, ids in zip(files, texts, tok.tok.encode_batch(texts, add_special_tokens=False)):
        assert tok.decode(ids.ids) == text, f
