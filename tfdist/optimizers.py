"""The training optimizer: AdamW with warmup + cosine decay, clipping and gradient accumulation.

Example:

    >>> from tfdist import config
    >>> from tfdist.optimizers import make_optimizer
    >>> opt = make_optimizer(config.default_config().train, total_steps=1000)
    >>> type(opt).__name__
    'AdamW'
"""
import keras


def make_optimizer(t, total_steps):
    """AdamW, linear warmup then cosine decay to min_learning_rate, global-norm clipping."""
    updates = total_steps // t.grad_accum_steps
    warmup = t.warmup_steps // t.grad_accum_steps
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else t.learning_rate,
        warmup_target=t.learning_rate if warmup else None, warmup_steps=warmup,
        decay_steps=max(1, updates - warmup), alpha=t.min_learning_rate / t.learning_rate)
    opt = keras.optimizers.AdamW(
        learning_rate=schedule, weight_decay=t.weight_decay, beta_1=t.beta1, beta_2=t.beta2,
        global_clipnorm=t.grad_clip or None,
        gradient_accumulation_steps=t.grad_accum_steps if t.grad_accum_steps > 1 else None)
    opt.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])  # as GPT-2 / nanoGPT
    return opt
