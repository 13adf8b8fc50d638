"""gpt2_medium: GPT-2 350M (24 layers, 16 heads, width 1024, context 1024, vocab 50257) for real hardware.

The vocabulary is GPT-2's size so that parameter counts match the paper; with tfdist's byte
tokenizer only the first 256 rows are used. Mixed bfloat16, as on current accelerators.
"""
from tfdist.config import gpt2_config


def get_config():
    return gpt2_config(n_layer=24, n_head=16, n_embd=1024)
