"""Tokenizers: bytes (the default), a byte-level BPE trained on the corpus, or files you have.

`data.tokenizer` chooses one:

* `byte`: every UTF-8 byte is a token (vocabulary 256); any text round-trips.
* `bpe`: a byte-level BPE with `data.vocab_size` tokens (including `<|endoftext|>`), trained on
  the corpus's training split by Hugging Face `tokenizers` (GPT-2's pre-tokenizer, no
  normalisation, so decoding gives back the exact text).
* a path: `.../vocab.json` (GPT-2 format, with `merges.txt` beside it: GPT-2's exact
  tokenization), a Hugging Face `tokenizer.json`, or a SentencePiece `.model`.

A tokenizer is saved with the token store and with every run (`save(dir)` writes its files and
returns its config; `load(dir, config)` reads them back), so `tfdist sample` decodes any model.
Documents are separated by the end-of-text token (`eot`) where the tokenizer has one, else by a
newline.

Example:

    >>> from tfdist.data.tokenizer import ByteTokenizer, train_bpe
    >>> tok = ByteTokenizer()
    >>> tok.decode(tok.encode("héllo"))
    'héllo'
    >>> bpe = train_bpe(["def f(x):\\n    return x\\n"] * 50, vocab_size=300)
    >>> bpe.decode(bpe.encode("def g(y): return y"))
    'def g(y): return y'
"""
import json
import os

import numpy as np

from tfdist.errors import UsageError

EOT = "<|endoftext|>"


class ByteTokenizer:
    """Bytes as tokens. `encode` returns uint8 ids; documents are separated by a newline."""
    kind = "byte"
    vocab_size = 256
    eot = None

    def encode(self, text):
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, ids):
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError("byte tokens must be in [0, 255]; the model produced an id out of "
                             "range")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, directory):
        return self.get_config()

    def get_config(self):
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eot": self.eot}


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (trained BPE, GPT-2's files, or a tokenizer.json)."""
    FILE = "tokenizer.json"

    def __init__(self, tokenizer, kind):
        self.tok, self.kind = tokenizer, kind
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot = tokenizer.token_to_id(EOT)

    def encode(self, text):
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts):
        return [np.asarray(e.ids, np.int64)
                for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); the model produced "
                             f"an id out of range")
        return self.tok.decode(ids, skip_special_tokens=True)

    def save(self, directory):
        import tensorflow as tf
        with tf.io.gfile.GFile(os.path.join(directory, self.FILE), "w") as f:
            f.write(self.tok.to_str())
        return {**self.get_config(), "file": self.FILE}

    def get_config(self):
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eot": self.eot}


class SentencePieceTokenizer:
    """A SentencePiece model (`.model` file). Its end-of-sentence id separates documents."""
    kind = "sentencepiece"
    FILE = "tokenizer.model"

    def __init__(self, proto):
        import sentencepiece as spm
        self.proto = proto
        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        self.vocab_size = self.sp.get_piece_size()
        self.eot = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text):
        return np.asarray(self.sp.encode(text), dtype=np.int64)

    def decode(self, ids):
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); the model produced "
                             f"an id out of range")
        return self.sp.decode(ids)

    def save(self, directory):
        import tensorflow as tf
        with tf.io.gfile.GFile(os.path.join(directory, self.FILE), "wb") as f:
            f.write(self.proto)
        return {**self.get_config(), "file": self.FILE}

    def get_config(self):
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eot": self.eot}


def _byte_level(model):
    """A tokenizer with GPT-2's byte-level pre-tokenizer and decoder around a BPE model."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts, vocab_size):
    """Trains a byte-level BPE of `vocab_size` tokens (256 bytes + EOT + merges) on an iterable of
    strings. Memory grows with the number of distinct words, not with the text."""
    from tokenizers import models, pre_tokenizers, trainers
    if vocab_size < 257:
        raise UsageError(f"data.vocab_size ({vocab_size}) must be at least 257 for a byte-level "
                         f"BPE (256 bytes and the end-of-text token)")
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, "bpe")


def _read(path, mode="r"):
    import tensorflow as tf
    with tf.io.gfile.GFile(path, mode) as f:
        return f.read()


def from_file(path):
    """A tokenizer from files the user has: GPT-2 `vocab.json` (+ `merges.txt` beside it), a
    Hugging Face `tokenizer.json`, or a SentencePiece `.model`."""
    import tensorflow as tf
    if not tf.io.gfile.exists(path):
        raise UsageError(f"tokenizer file '{path}' not found; set --config.data.tokenizer to byte, "
                         f"bpe, or an existing vocab.json, tokenizer.json or .model file")
    try:
        if path.endswith(".model"):
            return SentencePieceTokenizer(_read(path, "rb"))
        text = _read(path)
        spec = json.loads(text)
        if isinstance(spec, dict) and "model" in spec:  # a whole tokenizers JSON
            from tokenizers import Tokenizer
            return HFTokenizer(Tokenizer.from_str(text), "tokenizer.json")
        merges = os.path.join(os.path.dirname(path), "merges.txt")
        if not tf.io.gfile.exists(merges):
            raise UsageError(f"'{path}' is a GPT-2 vocabulary but there is no merges.txt beside "
                             f"it; put GPT-2's merges.txt in the same directory")
        return _gpt2(text, _read(merges))
    except UsageError:
        raise
    except Exception as e:  # bad JSON, a corrupt model file, ...
        raise UsageError(f"cannot load tokenizer '{path}' ({' '.join(str(e).split())[:150]}); "
                         f"give a GPT-2 vocab.json, a tokenizer.json or a SentencePiece "
                         f".model") from None


def _gpt2(vocab_json, merges_txt):
    """GPT-2's BPE from the text of its vocab.json and merges.txt (the `#version` line skipped)."""
    from tokenizers import models
    vocab = json.loads(vocab_json)
    merges = [tuple(line.split(" ")) for line in merges_txt.splitlines()
              if line and not line.startswith("#version")]
    return HFTokenizer(_byte_level(models.BPE(vocab=vocab, merges=merges)), "gpt2")


def load(directory, config):
    """The tokenizer saved in `directory` with `save`, described by `config` (its `get_config`)."""
    kind = config.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    path = os.path.join(directory, config.get("file", ""))
    try:
        if kind == "sentencepiece":
            return SentencePieceTokenizer(_read(path, "rb"))
        from tokenizers import Tokenizer
        return HFTokenizer(Tokenizer.from_str(_read(path)), kind)
    except Exception as e:
        raise UsageError(f"cannot read the tokenizer saved in {directory} "
                         f"({' '.join(str(e).split())[:150]}); prepare the data again") from None


def describe(config):
    return f"{config['kind']} ({config['vocab_size']:,} tokens)"
