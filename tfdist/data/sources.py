"""Corpus sources, all read through TensorFlow Datasets (TFDS).

* `stdlib`: the running Python's standard-library source (about 13 MB of .py files on 3.11, tests
  left out). Every machine has it, so nothing is downloaded.
* local text: files or directories the user names (comma-separated). Binary files are skipped.
* `tfds:<name>[/<config>]`: any TFDS dataset already prepared in `data_dir` (e.g. prepared with
  `tfds build` on a machine that has network access).

Local text is exposed as the TFDS builder `tfdist_text`, so once it has been prepared (tfdist does
that on first use, offline, in a second or two) `tfds.load` reads it like any other dataset:

    import tensorflow_datasets as tfds
    import tfdist.data.sources  # registers the builder
    ds = tfds.load("tfdist_text/python_stdlib", split="train", data_dir="/tmp/tfds")

`load_corpus(config.data)` turns any source into a `Corpus`: the train and validation byte streams.
"""
import contextlib
import dataclasses
import fcntl
import hashlib
import os
import sysconfig

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist.errors import UsageError

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files():
    """Sorted .py files of this Python's standard library, test suites and site-packages left out."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return out


def _is_text(path):
    with tf.io.gfile.GFile(path, "rb") as f:
        return b"\0" not in f.read(8192)


def text_files(paths):
    """Expands files and directories into a sorted list of text files; UsageError if one is missing."""
    out = []
    for p in paths:
        if not tf.io.gfile.exists(p):
            raise UsageError(f"data path '{p}' does not exist; set --config.data.source to existing "
                             f"text files or directories, or to 'stdlib'")
        if tf.io.gfile.isdir(p):
            for dirpath, dirnames, filenames in tf.io.gfile.walk(p):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                out += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
        else:
            out.append(p)
    out = [f for f in out if _is_text(f)]
    if not out:
        raise UsageError(f"no text files found in {', '.join(paths)}; point --config.data.source "
                         f"at UTF-8 text")
    return out


class TextCorpusConfig(tfds.core.BuilderConfig):
    """A set of local text files. `files` is resolved when the config is made."""

    def __init__(self, *, files, **kwargs):
        super().__init__(**kwargs)
        self.files = tuple(files)


class TfdistText(tfds.core.GeneratorBasedBuilder):
    """Local text files as a TFDS dataset: one example per file, features `text` and `path`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "One example per file."}
    BUILDER_CONFIGS = [TextCorpusConfig(
        name="python_stdlib", files=(), version="1.0.0",
        description="Source of the running Python's standard library (tests excluded).")]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.builder_config.name == "python_stdlib" and not self.builder_config.files:
            self.builder_config.files = tuple(stdlib_files())  # resolved lazily: import stays cheap

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                                 "path": tfds.features.Text()}),
            homepage="https://github.com/tfdist/tfdist")

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing is downloaded
        return {"train": self._generate_examples(self.builder_config.files)}

    def _generate_examples(self, files):
        for path in files:
            with tf.io.gfile.GFile(path, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
            yield path, {"text": text, "path": path}


def local_text_config(paths):
    """A builder config named by a hash of the files' paths, sizes and modification times."""
    files = text_files(paths)
    h = hashlib.sha1()
    for f in files:
        st = tf.io.gfile.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.length}:{st.mtime_nsec}\n".encode())
    return TextCorpusConfig(name="files_" + h.hexdigest()[:12], files=files, version="1.0.0",
                            description="Local text files: " + ", ".join(paths)[:200])


@dataclasses.dataclass
class Corpus:
    """A tokenized corpus: train and validation byte streams (uint8) and a content fingerprint."""
    name: str
    train: np.ndarray
    val: np.ndarray

    @property
    def fingerprint(self):
        h = hashlib.sha1(self.train.tobytes())
        h.update(self.val.tobytes())
        return h.hexdigest()[:16]


def _data_dir(data_config):
    return data_config.data_dir or os.path.expanduser("~/tensorflow_datasets")


@contextlib.contextmanager
def _prepare_lock(data_dir):
    """Serialises dataset preparation between processes sharing `data_dir` (several workers of one
    host, or of a cluster on a shared filesystem): TFDS itself does not guard concurrent
    `download_and_prepare` calls, and two writers can leave a half-written dataset. The first
    process prepares; the others wait, then find it prepared. (Remote data_dirs such as gs://
    are not locked: prepare those once, beforehand.)"""
    if "://" in data_dir:
        yield
        return
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, ".tfdist-prepare.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _join(ds, key):
    """Concatenates the text feature `key` of every example, newline-separated, as uint8."""
    parts = [ex[key] for ex in tfds.as_numpy(ds)]
    return np.frombuffer(b"\n".join(p if isinstance(p, bytes) else p.encode() for p in parts),
                         dtype=np.uint8).copy()


def _split(data, val_fraction):
    n_val = int(len(data) * val_fraction)
    return data[:len(data) - n_val], data[len(data) - n_val:]


def load_corpus(data_config):
    """Loads `data_config.source` (see module doc) into a Corpus, preparing local text if needed."""
    source = data_config.source.strip()
    data_dir = _data_dir(data_config)
    if source.startswith("tfds:"):
        return _load_tfds(source[len("tfds:"):], data_dir, data_config)
    if source == "stdlib":
        builder = TfdistText(config="python_stdlib", data_dir=data_dir)
    else:
        paths = [p.strip() for p in source.split(",") if p.strip()]
        builder = TfdistText(config=local_text_config(paths), data_dir=data_dir)
    with _prepare_lock(data_dir):
        builder.download_and_prepare()
    data = _join(builder.as_dataset(split="train", shuffle_files=False), "text")
    train, val = _split(data, data_config.val_fraction)
    return Corpus(name=f"tfdist_text/{builder.builder_config.name}", train=train, val=val)


def _load_tfds(name, data_dir, data_config):
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # DatasetNotFoundError, bad config name, ...
        raise UsageError(f"TFDS dataset '{name}' not found ({str(e).splitlines()[0][:120]}); "
                         f"check the name or --config.data.data_dir") from None
    if not builder.is_prepared():
        raise UsageError(f"TFDS dataset '{name}' is not prepared in {data_dir}; prepare it there "
                         f"first (`tfds build {name} --data_dir {data_dir}` where there is network)")
    key = data_config.text_key
    if key not in builder.info.features:
        raise UsageError(f"TFDS dataset '{name}' has no feature '{key}' (it has "
                         f"{', '.join(builder.info.features)}); set --config.data.text_key")
    train = _join(builder.as_dataset(split="train", shuffle_files=False), key)
    if "validation" in builder.info.splits:
        val = _join(builder.as_dataset(split="validation", shuffle_files=False), key)
    else:
        train, val = _split(train, data_config.val_fraction)
    return Corpus(name=name, train=train, val=val)
