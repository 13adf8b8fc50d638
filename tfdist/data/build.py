"""Building a token store from a source (`tfdist prepare`): streaming, in parallel, restartable.

    open_store(config.data)            # the store of this data config, prepared on first use
    build_store(config.data, out=DIR)  # into DIR (what `tfdist prepare --out=DIR` does)

How it runs:

1. The tokenizer: `byte`, loaded from the user's files, or (`bpe`) trained on the training text
   (at most `BPE_SAMPLE_BYTES` of it). It is saved into the store first.
2. Each work unit of the source (`tfdist.data.sources`, ~4 MB of text) is tokenized by a pool of
   `workers` processes into `.work/<split>-<unit>.bin`, written under a temporary name and renamed,
   with its counts in a `.json` beside it written after it: a unit with its `.json` is done.
3. The units' ids are packed in order into shards (`tfdist.data.store.ShardWriter`), then
   `manifest.json` is written, last, and `.work/` is removed.

So memory is bounded by a unit and a shard, whatever the corpus size; a killed prepare leaves no
manifest (the store is never taken as complete), and running it again skips the finished units and
yields the same store, with the same fingerprint. A directory holding another corpus's store, or
anything else, is refused.
"""
import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from tfdist.data import sources, store
from tfdist.data import tokenizer as tokenizers
from tfdist.errors import UsageError
from tfdist.runtime import process

BPE_SAMPLE_BYTES = 1 << 30  # a BPE is trained on at most the first 1 GiB of the training text
DEFAULT_BPE_VOCAB = 8192
WORK = ".work"


def tokenizer_spec(data_config):
    """What identifies the tokenizer of a data config: its kind, size, or its files' content."""
    t = data_config.tokenizer.strip()
    if t == "byte":
        return "byte"
    if t == "bpe":
        vocab = data_config.vocab_size or DEFAULT_BPE_VOCAB
        if vocab < 257:
            raise UsageError(f"data.vocab_size ({vocab}) must be at least 257 for a byte-level "
                             f"BPE (256 bytes and the end-of-text token)")
        return f"bpe-{vocab}"
    if not tf.io.gfile.exists(t):
        tokenizers.from_file(t)  # raises the one-line error
    h = hashlib.sha256()
    merges = os.path.join(os.path.dirname(t), "merges.txt")
    for p in [t] + ([merges] if t.endswith("vocab.json") and tf.io.gfile.exists(merges) else []):
        with tf.io.gfile.GFile(p, "rb") as f:
            h.update(f.read())
    return f"file-{h.hexdigest()[:12]}"


def default_out(data_config, name, key):
    return os.path.join(sources.data_dir_of(data_config), "tfdist", f"{name}-{key}")


def open_store(data_config, progress=True, workers=0):
    """The TokenStore for `data_config`, preparing it on first use (one process prepares; others
    sharing the directory wait for it)."""
    kind, rest = sources.scheme(data_config.source)
    if kind == "store":
        return store.TokenStore(rest)
    if kind == "nanogpt":
        return _nanogpt(rest, data_config)
    return build_store(data_config, progress=progress, workers=workers)


def _nanogpt(src, data_config):
    t = data_config.tokenizer.strip()
    if t == "bpe":
        raise UsageError("nanoGPT data is already tokenized: leave data.tokenizer=byte and state "
                         "data.vocab_size, or give its tokenizer's files (e.g. GPT-2's vocab.json)")
    tok = None if t == "byte" else tokenizers.from_file(t)
    vocab = data_config.vocab_size or (tok.vocab_size if tok else 0)
    if not vocab:
        raise UsageError("nanogpt: data needs its vocabulary size: set --config.data.vocab_size "
                         "(GPT-2 BPE: 50257), or give the tokenizer's files in data.tokenizer")
    h = hashlib.sha256(f"{vocab}:{tokenizer_spec(data_config)}:{data_config.shard_tokens}".encode())
    for name in ("train.bin", "val.bin"):
        path = os.path.join(src, name)
        if tf.io.gfile.exists(path):
            st = tf.io.gfile.stat(path)
            h.update(f"{os.path.abspath(path)}:{st.length}:{st.mtime_nsec}".encode())
    out = default_out(data_config, "nanogpt", h.hexdigest()[:12])
    with _lock(out):
        if store.read_manifest(out) is None:
            store.import_nanogpt(src, out, vocab, tokenizer=tok,
                                 shard_tokens=data_config.shard_tokens)
    return store.TokenStore(out)


@contextlib.contextmanager
def _lock(out):
    """Serialises preparation of one store between processes of this host (or of hosts sharing a
    POSIX filesystem). Remote paths (gs://) are not locked: prepare those once, beforehand."""
    if "://" in out:
        yield
        return
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    fd = os.open(parent, os.O_RDONLY)  # a lock on the directory itself: no lock file is left
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def build_store(data_config, out=None, workers=0, progress=True):
    """Prepares the store of a text source (stdlib, files, tfds:) into `out` (default: under
    data.data_dir, named by source and key). Returns the TokenStore."""
    kind, _ = sources.scheme(data_config.source)
    if kind in ("store", "nanogpt"):
        if out is None:
            return open_store(data_config)
        raise UsageError(f"data.source {data_config.source} is already tokenized; `tfdist prepare "
                         f"--out` takes text: stdlib, text paths or tfds:<name>")
    src = sources.resolve(data_config)
    for split in store.SPLITS:
        if not src.units[split]:
            raise UsageError(f"the {split} split of {src.name} would be empty; use more text or "
                             f"another data.val_fraction")
    spec = tokenizer_spec(data_config)
    ident = (f"{store.VERSION}:{src.key}:{spec}:{data_config.val_fraction}:"
             f"{data_config.shard_tokens}:{sources.UNIT_BYTES}")
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    out = out or default_out(data_config, f"{src.name}-{spec}", key[:12])
    _check_target(out, key)  # before the lock: a refused target is left untouched
    with _lock(out):
        _check_target(out, key)
        if store.read_manifest(out) is None:
            _build(src, data_config, out, key, workers or os.cpu_count() or 1, progress)
    return store.TokenStore(out)


def _check_target(out, key):
    """`out` must be this corpus's store (complete or in progress), or empty/absent."""
    m = store.read_manifest(out)
    if m is not None:
        if m.get("key") != key:
            raise UsageError(f"{out} holds the token store of another corpus or tokenizer "
                             f"({m['source']}, {tokenizers.describe(m['tokenizer'])}); choose "
                             f"another --out or remove it")
        return
    marker = os.path.join(out, WORK, "key")
    if tf.io.gfile.exists(marker):
        with tf.io.gfile.GFile(marker) as f:
            if f.read().strip() != key:
                raise UsageError(f"{out} holds an unfinished prepare of another corpus or "
                                 f"tokenizer; choose another --out or remove it")
        return
    if tf.io.gfile.exists(out) and tf.io.gfile.listdir(out):
        raise UsageError(f"{out} is not empty and holds no token store; choose an empty or new "
                         f"--out directory")


def _build(src, data_config, out, key, workers, progress):
    work = os.path.join(out, WORK)
    tf.io.gfile.makedirs(work)
    store.write_atomic(os.path.join(work, "key"), key)
    say = print if progress else (lambda *a, **k: None)
    tok_config = _tokenizer(src, data_config, out, work, say)
    jobs = [(split, k, unit) for split in store.SPLITS for k, unit in enumerate(src.units[split])]
    done = {j[:2] for j in jobs if tf.io.gfile.exists(_piece(work, j[0], j[1]) + ".json")}
    todo = [j for j in jobs if j[:2] not in done]
    say(f"tfdist prepare: {src.name} ({src.total_bytes / 1e6:,.1f} MB, {len(jobs)} units, "
        f"{len(jobs) - len(todo)} done before) -> {out} with {tokenizers.describe(tok_config)}, "
        f"{min(workers, max(len(todo), 1))} process(es)")
    bar = _Progress(src.total_bytes, progress)
    for split, k in sorted(done):
        bar.add(_stats(work, split, k), done_before=True)
    if todo:
        args = [(out, tok_config, *job) for job in todo]
        if workers > 1 and len(todo) > 1:
            # A fork when nothing forbids it (TF imported, its runtime not started: the check of
            # tfdist launch's agents) and the byte tokenizer needs no thread pool; else a fresh
            # process (spawn), which imports TF again (2-3 s of CPU).
            fork = tok_config["kind"] == "byte" and process.why_not_fork() is None
            ctx = multiprocessing.get_context("fork" if fork else "spawn")
            with _quiet_children() as children_stderr:  # TF's start-up notices in each child
                pool = ctx.Pool(min(workers, len(todo)), initializer=_init_worker)
            with pool:
                for stats in pool.imap_unordered(_tokenize_unit, args):
                    bar.add(stats)
            _pass_on(children_stderr)
        else:
            for a in args:
                bar.add(_tokenize_unit(a))
    bar.close()
    splits = {}
    for split in store.SPLITS:  # pack in order, then the manifest last
        w = store.ShardWriter(out, split, store.dtype_for(tok_config["vocab_size"]),
                              data_config.shard_tokens)
        totals = {"bytes": 0, "documents": 0}
        for k in range(len(src.units[split])):
            s = _stats(work, split, k)
            totals["bytes"] += s["bytes"]
            totals["documents"] += s["documents"]
            with tf.io.gfile.GFile(_piece(work, split, k) + ".bin", "rb") as f:
                w.write(np.frombuffer(f.read(), dtype=np.uint32))
        splits[split] = {**w.close(), **totals}
    m = store.write_manifest(out, source=data_config.source, key=key, tokenizer=tok_config,
                             splits=splits, shard_tokens=data_config.shard_tokens)
    tf.io.gfile.rmtree(work)
    s = m["splits"]
    say(f"tfdist prepare: done: {s['train']['tokens']:,} train / {s['val']['tokens']:,} validation "
        f"tokens in {s['train']['shards'] + s['val']['shards']} shards, "
        f"{s['train']['bytes'] / max(s['train']['tokens'], 1):.2f} bytes per token, fingerprint "
        f"{m['fingerprint'][:12]}")


def _tokenizer(src, data_config, out, work, say):
    """The tokenizer, saved into the store once (a restarted prepare reuses the saved one)."""
    done = os.path.join(work, "tokenizer.json")
    if tf.io.gfile.exists(done):
        with tf.io.gfile.GFile(done) as f:
            return json.load(f)
    t = data_config.tokenizer.strip()
    if t == "byte":
        tok = tokenizers.ByteTokenizer()
    elif t == "bpe":
        vocab = data_config.vocab_size or DEFAULT_BPE_VOCAB
        say(f"tfdist prepare: training a byte-level BPE of {vocab:,} tokens on the training text "
            f"(at most {BPE_SAMPLE_BYTES >> 20:,} MiB of it)")
        t0 = time.perf_counter()
        tok = tokenizers.train_bpe(_sample(src.units["train"]), vocab)
        say(f"tfdist prepare: BPE trained in {time.perf_counter() - t0:.1f} s")
    else:
        tok = tokenizers.from_file(t)
    config = tok.save(out)
    store.write_atomic(done, json.dumps(config))
    return config


def _sample(units):
    """The training text for BPE, streamed document by document, up to BPE_SAMPLE_BYTES."""
    seen = 0
    for unit in units:
        for text, n, _ in sources.read_unit(unit):
            yield text
            seen += n
            if seen >= BPE_SAMPLE_BYTES:
                return


def _piece(work, split, k):
    return os.path.join(work, f"{split}-{k:06d}")


def _stats(work, split, k):
    with tf.io.gfile.GFile(_piece(work, split, k) + ".json") as f:
        return json.load(f)


@contextlib.contextmanager
def _quiet_children():
    """Processes started inside write their stderr to a temporary file (this process's own
    stderr is restored on exit); `_pass_on` then shows what is not TF's start-up noise."""
    from tfdist.runtime import console
    if console.verbose():
        yield None
        return
    sys.stderr.flush()
    captured = tempfile.TemporaryFile()
    saved = os.dup(2)  # this process's stderr, restored on exit
    os.dup2(captured.fileno(), 2)
    try:
        yield captured
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _pass_on(captured):
    from tfdist.runtime import console
    if captured is None:
        return
    captured.seek(0)
    console.pass_on_stderr(captured.read())
    captured.close()


def _init_worker():
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism


_TOKENIZER = {}


def _tokenize_unit(args):
    """Tokenizes one work unit into its piece file (ids as uint32) and its counts."""
    out, tok_config, split, k, unit = args
    key = json.dumps(tok_config, sort_keys=True)
    if key not in _TOKENIZER:
        _TOKENIZER.clear()
        _TOKENIZER[key] = tokenizers.load(out, tok_config)
    tok = _TOKENIZER[key]
    sep = [tok.eot] if tok.eot is not None else list(tok.encode("\n"))
    parts = []  # the ids, in pieces
    nbytes = 0  # bytes of text
    docs = 0
    for text, n, ends_document in sources.read_unit(unit):
        if text:
            parts.append(np.asarray(tok.encode(text), np.uint32))
        if ends_document:
            parts.append(np.asarray(sep, np.uint32))
            docs += 1
            n += 1 if tok.eot is None else 0  # the newline separator is a byte of text
        nbytes += n
    ids = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    work = os.path.join(out, WORK)
    store.write_atomic(_piece(work, split, k) + ".bin", ids.astype("<u4").tobytes())
    stats = {"split": split, "unit": k, "bytes": nbytes, "tokens": int(ids.size), "documents": docs}
    store.write_atomic(_piece(work, split, k) + ".json", json.dumps(stats))
    return stats


class _Progress:
    """The progress over the source's megabytes, with MB/s, tokens/s and tokens so far
    (`tfdist.runtime.progress`: Keras's progress bar on a terminal, else a line per 5 % or so)."""

    def __init__(self, total_bytes, show):
        from tfdist.runtime.progress import Progress
        total = max(total_bytes / 1e6, 1e-3)
        self.bar = Progress(total, unit="MB", every=max(total / 20, 1e-3)) if show else None
        self.t0 = time.perf_counter()
        self.bytes = 0  # read so far, units done before included
        self.tokens = 0
        self.new_bytes = 0  # read by this prepare (its rates)
        self.new_tokens = 0

    def add(self, stats, done_before=False):
        self.bytes += stats["bytes"]
        self.tokens += stats["tokens"]
        if not done_before:
            self.new_bytes += stats["bytes"]
            self.new_tokens += stats["tokens"]
        if self.bar:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.update(self.bytes / 1e6, {"MB/s": self.new_bytes / 1e6 / dt,
                                               "tok/s": self.new_tokens / dt,
                                               "tokens": self.tokens})

    def close(self):
        if self.bar and self.bytes / 1e6 < self.bar.target:  # the bar is at self.bytes
            self.bar.update(self.bar.target, finalize=True)
