"""gpt2: GPT-2 124M (12 layers, 12 heads, width 768, context 1024, vocab 50257) for real hardware.

The vocabulary is GPT-2's size so that parameter counts match the paper; with tfdist's byte
tokenizer only the first 256 rows are used. Mixed bfloat16, as on current accelerators.
"""
from tfdist.config import gpt2_config


def get_config():
    return gpt2_config(n_layer=12, n_head=12, n_embd=768)
