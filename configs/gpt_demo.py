"""gpt_demo: what `make demo` trains on the default corpus in a few minutes on 2 CPU cores."""
from tfdist.config import default_config


def get_config():
    c = default_config()
    c.model.update(n_layer=4, n_head=4, n_embd=128, block_size=128)
    c.train.update(batch_size=32, steps=600, steps_per_epoch=200, learning_rate=2e-3,
                   min_learning_rate=2e-4, warmup_steps=50, eval_steps=20)
    c.backup.every_steps = 100
    return c
