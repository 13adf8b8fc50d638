"""gpt2_medium: GPT-2 350M (24 layers, 16 heads, width 1024, context 1024, vocab 50257) for real
hardware.

The vocabulary is GPT-2's size so that parameter counts match the paper: train it on GPT-2
tokens (`--config.data.tokenizer=<dir>/vocab.json`, or nanoGPT's
`--config.data.source=nanogpt:<dir>`); with a smaller tokenizer (bytes, a BPE of 8,192) the extra
rows go unused. Mixed bfloat16.
"""
from tfdist.config import gpt2_config


def get_config():
    return gpt2_config(n_layer=24, n_head=16, n_embd=1024)
