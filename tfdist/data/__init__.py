"""Data: byte tokenizer, corpus sources (through TFDS), and the windowed tf.data pipeline."""
from tfdist.data.pipeline import Windows  # noqa: F401
from tfdist.data.sources import Corpus, load_corpus  # noqa: F401
from tfdist.data.tokenizer import ByteTokenizer  # noqa: F401
