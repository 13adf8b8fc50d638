"""Data: tokenizer, TFDS sources, deterministic / resumable / sharded windows."""
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist import config
from tfdist.data import ByteTokenizer, Windows, load_corpus, sources
from tfdist.errors import UsageError


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    with pytest.raises(ValueError):
        tok.decode([300])


def test_default_corpus_is_the_stdlib_through_tfds(data_dir):
    c = config.default_config()
    c.data.data_dir = data_dir
    corpus = load_corpus(c.data)
    assert corpus.name == "tfdist_text/python_stdlib"
    assert len(corpus.train) > 5_000_000  # ~12 MB of Python on 3.11
    assert 0.04 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.06
    # tfds.load works on it once the builder is imported
    ds = tfds.load("tfdist_text/python_stdlib", split="train", data_dir=data_dir)
    paths = {ex["path"].numpy().decode() for ex in ds.take(2000)}
    assert any(p.endswith("/json/decoder.py") for p in paths)
    assert not any("/test/" in p or "site-packages" in p for p in paths)


def test_user_text_files_and_directories(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("alpha " * 500)
    (d / "b.md").write_text("beta " * 500)
    (d / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    one = tmp_path / "c.txt"
    one.write_text("gamma " * 500)
    c = config.default_config()
    c.data.data_dir = str(tmp_path / "tfds")
    c.data.source = f"{d},{one}"
    corpus = load_corpus(c.data)
    text = (corpus.train.tobytes() + corpus.val.tobytes()).decode()
    assert "alpha" in text and "beta" in text and "gamma" in text and "\0" not in text
    assert corpus.name.startswith("tfdist_text/files_")


def test_missing_path_is_a_usage_error(tmp_path):
    c = config.default_config()
    c.data.source = str(tmp_path / "nope")
    with pytest.raises(UsageError, match="does not exist"):
        load_corpus(c.data)


class TinyCorpus(tfds.core.GeneratorBasedBuilder):
    """A stand-in for a TFDS dataset prepared elsewhere (train and validation splits)."""
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"content": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples("train " * 300), "validation": self._generate_examples("valid " * 100)}

    def _generate_examples(self, text):
        for i in range(3):
            yield i, {"content": f"{i}:{text}"}


def test_prepared_tfds_dataset_uses_its_validation_split(tmp_path):
    TinyCorpus(data_dir=str(tmp_path)).download_and_prepare()
    c = config.default_config()
    c.data.data_dir, c.data.source, c.data.text_key = str(tmp_path), "tfds:tiny_corpus", "content"
    corpus = load_corpus(c.data)
    assert b"train" in corpus.train.tobytes() and b"train" not in corpus.val.tobytes()
    assert b"valid" in corpus.val.tobytes()
    c.data.text_key = "text"
    with pytest.raises(UsageError, match="no feature 'text'"):
        load_corpus(c.data)
    c.data.source = "tfds:no_such_dataset_xyz"
    with pytest.raises(UsageError, match="not found"):
        load_corpus(c.data)


def _batches(ds, n):
    return [(x.numpy(), y.numpy()) for x, y in ds.take(n)]


TOKENS = np.frombuffer(bytes(range(256)) * 200, np.uint8)


def test_windows_are_targets_shifted_and_deterministic():
    w = Windows(TOKENS, block_size=16, global_batch=8, seed=5)
    a = _batches(w.dataset_fn(0, 5)(None), 5)
    b = _batches(Windows(TOKENS, 16, 8, seed=5).dataset_fn(0, 5)(None), 5)
    for (x, y), (x2, y2) in zip(a, b):
        assert x.shape == (8, 16) and x.dtype == np.int32
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
        np.testing.assert_array_equal((x[:, 0] + 1) % 256, y[:, 0])
        np.testing.assert_array_equal(x, x2)
    other = _batches(Windows(TOKENS, 16, 8, seed=6).dataset_fn(0, 1)(None), 1)
    assert not np.array_equal(other[0][0], a[0][0])


def test_resume_at_step_reads_exactly_the_remaining_batches():
    w = Windows(TOKENS, block_size=16, global_batch=8, seed=1)
    full = _batches(w.dataset_fn(0, 10)(None), 10)
    tail = _batches(w.dataset_fn(6, 4)(None), 10)
    assert len(tail) == 4
    for (x, _), (x2, _) in zip(full[6:], tail):
        np.testing.assert_array_equal(x, x2)


@pytest.mark.parametrize("pipelines,replicas", [(1, 2), (2, 2), (2, 4), (1, 4)])
def test_shards_across_replicas_make_up_the_global_batch(pipelines, replicas):
    """One global step's rows across all replicas are the single-replica global batch, no dups."""
    w = Windows(TOKENS, block_size=16, global_batch=8, seed=2)
    whole = _batches(w.dataset_fn(3, 2)(None), 2)
    local = replicas // pipelines
    for step in range(2):
        rows = []
        for p in range(pipelines):
            ctx = tf.distribute.InputContext(num_input_pipelines=pipelines, input_pipeline_id=p,
                                             num_replicas_in_sync=replicas)
            per = _batches(w.dataset_fn(3, 2)(ctx), 2 * local)
            assert all(x.shape == (8 // replicas, 16) for x, _ in per)
            rows += [x for x, _ in per[step * local:(step + 1) * local]]
        np.testing.assert_array_equal(np.concatenate(rows), whole[step][0])
        assert len({r.tobytes() for r in np.concatenate(rows)}) == 8


def test_too_short_corpus_is_refused():
    with pytest.raises(ValueError, match="shorter than one window"):
        Windows(np.zeros(10, np.uint8), block_size=16, global_batch=2, seed=0)


def test_stdlib_file_list_skips_tests_and_site_packages():
    files = sources.stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any(os.sep + "test" + os.sep in f or "site-packages" in f for f in files)
