"""gpt_nano: the test model (2 layers, 2 heads, width 64, context 64; ~0.1 M parameters)."""
from tfdist.config import default_config


def get_config():
    c = default_config()
    c.model.update(n_layer=2, n_head=2, n_embd=64, block_size=64)
    c.train.update(batch_size=16, steps=40, steps_per_epoch=20, warmup_steps=4, eval_steps=4)
    c.backup.every_steps = 10
    return c
