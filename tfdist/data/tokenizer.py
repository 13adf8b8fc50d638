"""Byte-level tokenizer: every byte is a token, so vocab_size is 256 and any text round-trips.

Example:

    from tfdist.data.tokenizer import ByteTokenizer
    tok = ByteTokenizer()
    ids = tok.encode("héllo")          # numpy uint8 array of UTF-8 bytes
    assert tok.decode(ids) == "héllo"
"""
import numpy as np


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text):
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, ids):
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError("byte tokens must be in [0, 255]; the model produced an id out of range")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def get_config(self):
        return {"name": "bytes", "vocab_size": self.vocab_size}
