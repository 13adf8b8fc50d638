"""gpt2_large: GPT-2 774M (36 layers, 20 heads, width 1280, context 1024, vocab 50257) for real hardware.

The vocabulary is GPT-2's size so that parameter counts match the paper; with tfdist's byte
tokenizer only the first 256 rows are used. Mixed bfloat16 as on current accelerators.
"""
from tfdist.config import default_config


def get_config():
    c = default_config()
    c.model.update(n_layer=36, n_head=20, n_embd=1280, block_size=1024, vocab_size=50257, dropout=0.0)
    c.train.update(batch_size=512, steps=600000, steps_per_epoch=2000, learning_rate=6e-4,
                   min_learning_rate=6e-5, warmup_steps=2000, eval_steps=200,
                   precision="mixed_bfloat16")
    c.backup.every_steps = 1000
    return c
