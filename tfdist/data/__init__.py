"""Data: tokenizers, corpus sources, the on-disk token store, and the windowed tf.data pipeline."""
from tfdist.data.build import open_store  # noqa: F401
from tfdist.data.pipeline import Windows  # noqa: F401
from tfdist.data.store import TokenStore  # noqa: F401
from tfdist.data.tokenizer import ByteTokenizer  # noqa: F401
