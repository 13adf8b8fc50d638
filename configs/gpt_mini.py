"""gpt_mini: the benchmark model (6 layers, 6 heads, width 384, context 256; ~10.8 M parameters)."""
from tfdist.config import default_config


def get_config():
    c = default_config()
    c.model.update(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.0)
    c.train.update(batch_size=16, steps=2000, steps_per_epoch=250, learning_rate=1e-3,
                   min_learning_rate=1e-4, warmup_steps=100, eval_steps=20)
    c.backup.every_steps = 250
    return c
