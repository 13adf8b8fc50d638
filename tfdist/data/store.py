"""The token store: a corpus as token ids on disk, read by step without loading it.

Format (a directory; every access goes through `tf.io.gfile`, so it can live on `gs://`):

    manifest.json          written last: a store without it is incomplete and never read
    tokenizer.json | tokenizer.model   the tokenizer's files (none for `byte`)
    train/000000.bin ...   token ids, little-endian uint16 (vocabulary <= 65536) or uint32,
    val/000000.bin ...     no header; every shard holds exactly `shard_tokens` ids but the last

`manifest.json` holds `format` and `version`, the `source`, the `tokenizer` config (kind, vocab
size, end-of-text id, file), `vocab_size`, `dtype`, `shard_tokens`, and per split the `tokens`,
the UTF-8 `bytes` they encode (for bits per byte; null when unknown), `documents` and `shards`;
`key` identifies what it was made from (source, tokenizer, split) and `fingerprint` is the SHA-256
of its token ids and tokenizer, so two stores with one fingerprint train identically.

nanoGPT's format (a directory with `train.bin` / `val.bin` of raw uint16 ids, as its
`prepare.py` writes them) is read by `import_nanogpt`, which shards the two files into a store
(a copy of the ids, no re-tokenization: TF has no op that reads a byte range of a file, and
reading a 17 GB file through to an offset takes seconds per window).

Reading (`Split.windows`) uses TF ops only (`tf.io.read_file` of the shards a window touches,
`tf.strings.substr`, `tf.io.decode_raw`), so it runs wherever the graph runs: in any input
pipeline, on a TPU host, and inside functions scheduled on parameter-server workers, which read the
store by path. A process holds only the shards of the batch it reads: its memory does not grow
with the corpus.

Example:

    >>> import os, tempfile
    >>> import numpy as np
    >>> from tfdist.data import store
    >>> s = store.from_arrays(os.path.join(tempfile.mkdtemp(), "tiny-store"),
    ...                       train=np.arange(5000) % 256, val=np.arange(900) % 256,
    ...                       vocab_size=256, shard_tokens=1024)
    >>> x = s.split("train").windows([0, 1020], 9)    # the second window spans two shards
    >>> x.dtype.name, tuple(x.shape), x.numpy()[1, :6].tolist()
    ('int32', (2, 9), [252, 253, 254, 255, 0, 1])
"""
import hashlib
import json
import os

import numpy as np
import tensorflow as tf

from tfdist.errors import UsageError

FORMAT = "tfdist-token-store"
VERSION = 1
MANIFEST = "manifest.json"
# 128 Ki tokens (256 KiB at uint16): a window reads its whole shard (TF has no ranged read), so
# smaller shards read less per window; 2 MiB shards cost 4.4 ms a window here, 4 % of a gpt_mini
# step.
SHARD_TOKENS = 1 << 17
SPLITS = ("train", "val")


def dtype_for(vocab_size):
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_path(directory, split, index):
    return os.path.join(directory, split, f"{index:06d}.bin")


def write_atomic(path, data):
    """Writes bytes or text through a temporary file and a rename: a kill never leaves a partial
    file under the final name."""
    tmp = path + ".tmp"
    with tf.io.gfile.GFile(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    tf.io.gfile.rename(tmp, path, overwrite=True)


class ShardWriter:
    """Appends token ids to one split's shards; each shard appears only when complete (the last at
    `close`). Hashes the ids as they go. Holds at most one shard in memory."""

    def __init__(self, directory, split, dtype, shard_tokens=SHARD_TOKENS):
        self.dir = directory
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        tf.io.gfile.makedirs(os.path.join(directory, split))
        self.buffer = []  # the parts of the shard being filled
        self.buffered = 0  # ids in `buffer`
        self.shards = 0  # shards written
        self.tokens = 0  # ids written
        self.hash = hashlib.sha256()

    def write(self, ids):
        ids = np.asarray(ids).astype(f"<{self.dtype[0]}{np.dtype(self.dtype).itemsize}", copy=False)
        while ids.size:
            part = ids[:self.shard_tokens - self.buffered]
            self.buffer.append(part)
            self.buffered += len(part)
            ids = ids[len(part):]
            if self.buffered == self.shard_tokens:
                self._flush()

    def _flush(self):
        if not self.buffered:
            return
        data = np.concatenate(self.buffer).tobytes()
        self.buffer = []
        self.buffered = 0
        write_atomic(shard_path(self.dir, self.split, self.shards), data)
        self.hash.update(data)
        self.shards += 1
        self.tokens += len(data) // np.dtype(self.dtype).itemsize

    def close(self):
        self._flush()
        return {"tokens": self.tokens, "shards": self.shards, "sha256": self.hash.hexdigest()}


def write_manifest(directory, *, source, key, tokenizer, splits, shard_tokens):
    """Writes manifest.json (atomically, last): the store is complete from then on."""
    h = hashlib.sha256(json.dumps(tokenizer, sort_keys=True).encode())
    for name in SPLITS:
        h.update(splits[name].pop("sha256").encode())
    manifest = {"format": FORMAT, "version": VERSION, "source": source, "key": key,
                "tokenizer": tokenizer, "vocab_size": tokenizer["vocab_size"],
                "dtype": dtype_for(tokenizer["vocab_size"]), "shard_tokens": shard_tokens,
                "splits": splits, "fingerprint": h.hexdigest()[:32]}
    write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory):
    """The manifest of a complete store, or None if `directory` holds none; UsageError if it is
    damaged."""
    path = os.path.join(directory, MANIFEST)
    if not tf.io.gfile.exists(path):
        return None
    try:
        with tf.io.gfile.GFile(path) as f:
            m = json.load(f)
        assert m["format"] == FORMAT and m["version"] == VERSION
        for name in SPLITS:
            assert m["splits"][name]["tokens"] >= 0 and m["splits"][name]["shards"] >= 0
        assert m["dtype"] in ("uint16", "uint32") and m["shard_tokens"] > 0
    except Exception:
        raise UsageError(f"the token store manifest {path} is damaged or not a tfdist store; "
                         f"remove {directory} and prepare it again (`tfdist prepare`)") from None
    return m


class TokenStore:
    """A complete store, opened and checked: the manifest, and every shard's size."""

    def __init__(self, directory):
        self.dir = directory.rstrip("/")
        m = read_manifest(self.dir)
        if m is None:
            raise UsageError(f"{self.dir} is not a prepared token store (no {MANIFEST}); prepare "
                             f"it with `tfdist prepare` or point data.source at one")
        self.manifest = m
        self.vocab_size = m["vocab_size"]
        self.dtype = m["dtype"]
        self.fingerprint = m["fingerprint"]
        self.shard_tokens = m["shard_tokens"]
        self._check_shards()

    def _check_shards(self):
        width = np.dtype(self.dtype).itemsize
        for name in SPLITS:
            s = self.manifest["splits"][name]
            for i in range(s["shards"]):
                want = min(self.shard_tokens, s["tokens"] - i * self.shard_tokens) * width
                path = shard_path(self.dir, name, i)
                size = tf.io.gfile.stat(path).length if tf.io.gfile.exists(path) else None
                if size != want:
                    got = "missing" if size is None else f"{size:,} bytes"
                    raise UsageError(
                        f"token store shard {path} is {got}, not {want:,}; the store is damaged: "
                        f"remove {self.dir} and prepare it again")

    @property
    def tokenizer_config(self):
        return self.manifest["tokenizer"]

    def tokenizer(self):
        from tfdist.data import tokenizer
        return tokenizer.load(self.dir, self.tokenizer_config)

    def split(self, name):
        return Split(self, name)

    def describe(self):
        from tfdist.data.tokenizer import describe
        s = self.manifest["splits"]
        return (f"token store {self.dir} ({self.manifest['source']}, "
                f"{describe(self.tokenizer_config)}): {s['train']['tokens']:,} train / "
                f"{s['val']['tokens']:,} validation tokens")


class Split:
    """One split of a store: `windows(offsets, length)` reads token windows with TF ops."""

    def __init__(self, store, name):
        meta = store.manifest["splits"][name]
        self.store = store
        self.name = name
        self.num_tokens = meta["tokens"]
        self.bytes = meta.get("bytes")  # of the text the tokens encode (None: not known)
        self.shard_tokens = min(store.shard_tokens, max(self.num_tokens, 1))
        self._prefix = os.path.join(store.dir, name) + "/"
        self._width = np.dtype(store.dtype).itemsize
        self._dtype = tf.uint16 if store.dtype == "uint16" else tf.int32  # ids < 2**31

    @property
    def bytes_per_token(self):
        """UTF-8 bytes of text per token (None when the store does not know its text's size)."""
        return self.bytes / self.num_tokens if self.bytes and self.num_tokens else None

    def _read(self, shard, start, count):
        """`count` ids from `start` in shard `shard` (int64 scalars), as a byte string."""
        path = tf.strings.join([self._prefix, tf.strings.as_string(shard, width=6, fill="0"),
                                ".bin"])
        return tf.strings.substr(tf.io.read_file(path), start * self._width, count * self._width)

    def windows(self, offsets, length):
        """int32 (len(offsets), length): the ids at `offset .. offset + length - 1` of this split
        for each offset (int64). A window touches at most two shards (`length <= shard_tokens`)."""
        if length > self.shard_tokens and self.num_tokens > self.shard_tokens:
            raise UsageError(f"windows of {length} tokens are longer than the store's shards "
                             f"({self.shard_tokens}); prepare it with more data.shard_tokens")
        S, n = tf.constant(self.shard_tokens, tf.int64), tf.constant(length, tf.int64)

        def window(offset):
            shard, start = offset // S, offset % S
            head = tf.minimum(n, S - start)
            data = self._read(shard, start, head)
            data = tf.cond(head < n, lambda: data + self._read(shard + 1, tf.constant(0, tf.int64),
                                                                n - head), lambda: data)
            return data

        raw = tf.map_fn(window, tf.cast(offsets, tf.int64), fn_output_signature=tf.string)
        ids = tf.io.decode_raw(raw, self._dtype, little_endian=True,
                               fixed_length=length * self._width)
        return tf.cast(ids, tf.int32)


def from_arrays(directory, *, train, val, vocab_size=256, tokenizer=None, source="arrays",
                shard_tokens=SHARD_TOKENS, bytes_per_token=None):
    """Writes a store from in-memory token arrays (tests, tools, small corpora). With a `tokenizer`
    object its files are saved too; else it must be the byte tokenizer's vocabulary or the caller's
    stated one (kind `ids`)."""
    tf.io.gfile.makedirs(directory)
    if tokenizer is not None:
        tok_config = tokenizer.save(directory)
    elif vocab_size == 256:
        tok_config = {"kind": "byte", "vocab_size": 256, "eot": None}
    else:
        tok_config = {"kind": "ids", "vocab_size": vocab_size, "eot": None}
    splits = {}
    for name, ids in (("train", train), ("val", val)):
        w = ShardWriter(directory, name, dtype_for(tok_config["vocab_size"]), shard_tokens)
        w.write(np.asarray(ids))
        splits[name] = w.close()
        bpt = 1.0 if tok_config["kind"] == "byte" else bytes_per_token
        splits[name].update(documents=1, bytes=round(bpt * splits[name]["tokens"]) if bpt else None)
    key = hashlib.sha256(f"{source}:{splits['train']['sha256']}".encode()).hexdigest()[:16]
    write_manifest(directory, source=source, key=key, tokenizer=tok_config, splits=splits,
                   shard_tokens=shard_tokens)
    return TokenStore(directory)


def import_nanogpt(src, out, vocab_size, tokenizer=None, shard_tokens=SHARD_TOKENS, chunk=1 << 24):
    """Shards nanoGPT's `train.bin` / `val.bin` (raw uint16 ids) from `src` into a store at `out`,
    streaming (`chunk` ids at a time). Ids must be below `vocab_size`."""
    paths = {"train": os.path.join(src, "train.bin"), "val": os.path.join(src, "val.bin")}
    for name, path in paths.items():
        if not tf.io.gfile.exists(path):
            raise UsageError(f"nanoGPT directory {src} has no {name}.bin; it needs train.bin and "
                             f"val.bin as nanoGPT's prepare.py writes them")
        size = tf.io.gfile.stat(path).length
        if size % 2:
            raise UsageError(f"{path} is {size:,} bytes, not a whole number of uint16 tokens; the "
                             f"file is truncated or not nanoGPT's format")
    tok_config = (tokenizer.get_config() if tokenizer is not None else
                  {"kind": "ids", "vocab_size": vocab_size, "eot": None})
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        vocab_size = tokenizer.vocab_size
    tok_config["vocab_size"] = vocab_size
    if vocab_size > 1 << 16:
        raise UsageError(f"data.vocab_size {vocab_size} does not fit nanoGPT's uint16 ids")
    created = not tf.io.gfile.exists(out)
    tf.io.gfile.makedirs(out)
    try:
        return _import_nanogpt(paths, src, out, vocab_size, tokenizer, tok_config, shard_tokens,
                               chunk)
    except BaseException:
        if created:  # leave nothing behind that we made
            tf.io.gfile.rmtree(out)
        raise


def _import_nanogpt(paths, src, out, vocab_size, tokenizer, tok_config, shard_tokens, chunk):
    if tokenizer is not None:
        tok_config = {**tokenizer.save(out), "vocab_size": vocab_size}
    splits = {}
    h = hashlib.sha256()  # the key: the splits' ids
    for name, path in paths.items():
        w = ShardWriter(out, name, "uint16", shard_tokens)
        with tf.io.gfile.GFile(path, "rb") as f:
            while True:
                ids = np.frombuffer(f.read(chunk * 2), dtype="<u2")
                if not ids.size:
                    break
                if int(ids.max()) >= vocab_size:
                    raise UsageError(f"{path} holds token id {int(ids.max())}, not below the "
                                     f"stated vocabulary size {vocab_size}; set data.vocab_size "
                                     f"to the tokenizer's size (GPT-2: 50257)")
                w.write(ids)
        splits[name] = {**w.close(), "documents": None, "bytes": None}
        h.update(splits[name]["sha256"].encode())
    return write_manifest(out, source=f"nanogpt:{src}", key=h.hexdigest()[:16],
                          tokenizer=tok_config, splits=splits, shard_tokens=shard_tokens)
