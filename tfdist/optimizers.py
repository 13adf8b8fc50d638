"""The training optimizer: AdamW with linear warmup and cosine decay.

Clipping by the global norm (`train.grad_clip`) and gradient accumulation
(`train.grad_accum_steps`) are tfdist's training step's (`tfdist.step.TrainStep`): they must see
the gradients reduced over the replicas. The schedule counts optimizer updates, one per
`grad_accum_steps` batches.

Example:

    >>> from tfdist import config
    >>> from tfdist.optimizers import make_optimizer
    >>> opt = make_optimizer(config.default_config().train, total_steps=1000)
    >>> type(opt).__name__, opt.global_clipnorm, opt.gradient_accumulation_steps
    ('AdamW', None, None)
"""
import keras


def make_optimizer(t, total_steps):
    """AdamW (config section `t` = `train`), linear warmup then cosine decay to
    min_learning_rate over the updates of `total_steps` batches."""
    updates = total_steps // t.grad_accum_steps
    warmup = t.warmup_steps // t.grad_accum_steps
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else t.learning_rate,
        warmup_target=t.learning_rate if warmup else None, warmup_steps=warmup,
        decay_steps=max(1, updates - warmup), alpha=t.min_learning_rate / t.learning_rate)
    opt = keras.optimizers.AdamW(learning_rate=schedule, weight_decay=t.weight_decay,
                                 beta_1=t.beta1, beta_2=t.beta2)
    opt.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])  # as GPT-2 / nanoGPT
    return opt


class Scaled(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule times a constant (Horovod's linear learning-rate scaling: its warmup then ramps
    to the scaled rate)."""

    def __init__(self, schedule, factor):
        self.schedule, self.factor = schedule, factor

    def __call__(self, step):
        return self.schedule(step) * self.factor

    def get_config(self):
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule),
                "factor": self.factor}

    @classmethod
    def from_config(cls, config):
        return cls(keras.optimizers.schedules.deserialize(config["schedule"]), config["factor"])
