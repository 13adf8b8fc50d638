"""Corpus sources, as lists of work units that `tfdist prepare` tokenizes in parallel.

`data.source` is one of:

* `stdlib` (the default): the running Python's standard-library source (about 12 MB of .py
  files on 3.11, test suites and site-packages left out). Every machine has it.
* text files or directories, comma-separated (binary files are skipped); `gs://` paths too;
* `tfds:<name>[/<config>]`: a TensorFlow Datasets dataset already prepared in `data.data_dir`
  (feature `data.text_key`); its `validation` split if it has one;
* `nanogpt:<dir>`: nanoGPT's `train.bin` / `val.bin` (see `tfdist.data.store.import_nanogpt`);
* `store:<dir>`: a token store that `tfdist prepare` wrote.

Text is cut into units of about `UNIT_BYTES` at line boundaries, so one file of any size is
tokenized in parallel and memory stays bounded. Each file is a document, each TFDS example too.
Without a validation split, the last `data.val_fraction` of the text (by bytes, at a line
boundary; for TFDS by examples) is kept for validation.

Example:

    >>> from tfdist import config
    >>> from tfdist.data import sources
    >>> c = config.default_config()
    >>> src = sources.resolve(c.data)                 # stdlib: ~730 files in ~12 MB
    >>> docs = list(sources.read_unit(src.units["val"][0]))
    >>> len(docs) > 0
    True
"""
import dataclasses
import hashlib
import os
import sysconfig

import tensorflow as tf

from tfdist.errors import UsageError

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
UNIT_BYTES = 4 << 20
SCHEMES = ("stdlib", "tfds", "nanogpt", "store")


def stdlib_files():
    """Sorted .py files of this Python's standard library, test suites and site-packages left
    out."""
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
    """Expands files and directories into a sorted list of text files; UsageError if one is
    missing."""
    out = []
    for p in paths:
        if not tf.io.gfile.exists(p):
            raise UsageError(f"data path '{p}' does not exist; set --config.data.source to "
                             f"existing text files or directories, or to 'stdlib'")
        if tf.io.gfile.isdir(p):
            for dirpath, dirnames, filenames in tf.io.gfile.walk(p):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                out += [os.path.join(dirpath, f) for f in sorted(filenames)
                        if not f.startswith(".")]
        else:
            out.append(p)
    out = [f for f in out if _is_text(f)]
    if not out:
        raise UsageError(f"no text files found in {', '.join(paths)}; point --config.data.source "
                         f"at UTF-8 text")
    return out


def scheme(source):
    """(scheme, rest) of `data.source`: a known scheme, or ('files', source). An unknown
    `word:` prefix (not a path, not a URL such as gs://) is a UsageError."""
    source = source.strip()
    if source == "stdlib":
        return "stdlib", ""
    head, sep, rest = source.partition(":")
    if sep and not rest.startswith("//") and "/" not in head and "," not in head and len(head) > 1:
        if head not in SCHEMES:
            raise UsageError(f"unknown data source scheme '{head}:'; use stdlib, text paths, "
                             f"tfds:<name>, nanogpt:<dir> or store:<dir>")
        return head, rest
    return "files", source


@dataclasses.dataclass
class Source:
    """What a corpus is made of: a name, a key (changes when its content may have), the work
    units of each split, and the total bytes to read (for progress)."""
    name: str
    key: str
    units: dict
    total_bytes: int


def resolve(data_config):
    """The `Source` for stdlib, text paths or tfds:<name> (nanogpt: and store: are not text)."""
    kind, rest = scheme(data_config.source)
    if kind == "tfds":
        return _tfds(rest, data_config)
    if kind == "stdlib":
        files = stdlib_files()
        name = "python_stdlib"
    elif kind == "files":
        files = text_files([p.strip() for p in rest.split(",") if p.strip()])
        name = "files"
    else:
        raise ValueError(kind)
    return _files(files, name, data_config.val_fraction)


def _files(files, name, val_fraction):
    """Units over the concatenation of `files`: (path, start, end, last-of-file) byte ranges."""
    sizes = []
    h = hashlib.sha256()  # the key: each file's path, size and time
    for f in files:
        st = tf.io.gfile.stat(f)
        sizes.append(st.length)
        path = os.path.abspath(f) if "://" not in f else f
        h.update(f"{path}:{st.length}:{st.mtime_nsec}\n".encode())
    total = sum(sizes)
    # the validation text starts at the first line start >= cut
    cut = total - int(total * val_fraction)
    units = {"train": [], "val": []}
    pos = 0
    for f, size in zip(files, sizes):
        for split, lo, hi in (("train", 0, cut), ("val", cut, total)):
            a, b = max(lo - pos, 0), min(hi - pos, size)
            while a < b:
                e = min(a + UNIT_BYTES, b)
                units[split].append(("file", f, a, e, size, e == size))
                a = e
        pos += size
    return Source(name, h.hexdigest()[:16], units, total)


def _tfds(name, data_config):
    import tensorflow_datasets as tfds
    data_dir = data_dir_of(data_config)
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as e:  # DatasetNotFoundError, bad config name, ...
        raise UsageError(f"TFDS dataset '{name}' not found ({str(e).splitlines()[0][:120]}); "
                         f"check the name or --config.data.data_dir") from None
    if not builder.is_prepared():
        raise UsageError(f"TFDS dataset '{name}' is not prepared in {data_dir}; prepare it there "
                         f"first (`tfds build {name} --data_dir {data_dir}` where there is "
                         f"network)")
    key = data_config.text_key
    if key not in builder.info.features:
        raise UsageError(f"TFDS dataset '{name}' has no feature '{key}' (it has "
                         f"{', '.join(builder.info.features)}); set --config.data.text_key")
    splits = builder.info.splits
    n = splits["train"].num_examples
    if "validation" in splits:
        ranges = {"train": ("train", 0, n),
                  "val": ("validation", 0, splits["validation"].num_examples)}
    else:
        k = max(1, int(n * data_config.val_fraction))
        ranges = {"train": ("train", 0, n - k), "val": ("train", n - k, n)}
    total = sum(splits[s].num_bytes for s in set(r[0] for r in ranges.values()))
    per_unit = max(1, int(n * UNIT_BYTES / max(total, 1)))
    units = {}
    for split, (tfds_split, a, b) in ranges.items():
        units[split] = [("tfds", name, data_dir, tfds_split, i, min(i + per_unit, b), key)
                        for i in range(a, b, per_unit)]
    counts = [(s, splits[s].num_examples) for s in splits]
    ident = f"tfds:{name}:{builder.info.version}:{key}:{counts}"
    return Source(name.replace("/", "_"), hashlib.sha256(ident.encode()).hexdigest()[:16], units,
                  total)


def data_dir_of(data_config):
    return data_config.data_dir or os.path.expanduser("~/tensorflow_datasets")


def _line_start(f, pos):
    """The first position >= pos that starts a line (0, or just after a newline)."""
    if pos == 0:
        return 0
    f.seek(pos - 1)
    while True:
        block = f.read(1 << 16)
        if not block:
            return f.tell()
        i = block.find(b"\n")
        if i >= 0:
            return f.tell() - len(block) + i + 1


def read_unit(unit):
    """Yields (text, its UTF-8 bytes in the source, ends a document) for one work unit."""
    if unit[0] == "file":
        _, path, a, b, size, last = unit
        with tf.io.gfile.GFile(path, "rb") as f:
            start, end = _line_start(f, a), _line_start(f, b) if b < size else size
            if end > start:
                f.seek(start)
                data = f.read(end - start)
                yield data.decode("utf-8", errors="replace"), len(data), last
            elif last:
                yield "", 0, True
        return
    _, name, data_dir, split, a, b, key = unit
    import tensorflow_datasets as tfds
    ds = tfds.builder(name, data_dir=data_dir).as_dataset(split=f"{split}[{a}:{b}]",
                                                          shuffle_files=False)
    for ex in tfds.as_numpy(ds):
        v = ex[key]
        text = v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
        yield text, len(v), True
