"""gpt2_large: GPT-2 774M (36 layers, 20 heads, width 1280, context 1024, vocab 50257) for real hardware.

The vocabulary is GPT-2's size so that parameter counts match the paper; with tfdist's byte
tokenizer only the first 256 rows are used. Mixed bfloat16, as on current accelerators.
"""
from tfdist.config import gpt2_config


def get_config():
    return gpt2_config(n_layer=36, n_head=20, n_embd=1280)
