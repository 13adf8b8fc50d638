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

from tfdist import compat


def make_optimizer(t, total_steps, cls=None):
    """AdamW (config section `t` = `train`; tfdist's `AdamW`, or `cls`), linear warmup then
    cosine decay to min_learning_rate over the updates of `total_steps` batches."""
    updates = total_steps // t.grad_accum_steps
    warmup = t.warmup_steps // t.grad_accum_steps
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else t.learning_rate,
        warmup_target=t.learning_rate if warmup else None, warmup_steps=warmup,
        decay_steps=max(1, updates - warmup), alpha=t.min_learning_rate / t.learning_rate)
    opt = (cls or AdamW)(learning_rate=schedule, weight_decay=t.weight_decay, beta_1=t.beta1,
                         beta_2=t.beta2)
    opt.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])  # as GPT-2 / nanoGPT
    return opt


@keras.saving.register_keras_serializable("tfdist")
class AdamW(keras.optimizers.AdamW):
    """Keras's AdamW, with each variable's Adam update one TensorFlow op: `ResourceApplyAdam`,
    the fused kernel tf.keras 2 used, where Keras 3 runs about a dozen ops, each a pass over the
    variable (as PyTorch's foreach/fused AdamW are to its for-loop one). The same arithmetic
    (tests/test_fast_step.py); the decoupled weight decay stays Keras's. Other backends, amsgrad and
    sparse gradients take Keras's own update.

        >>> import numpy as np
        >>> w = keras.Variable(np.ones(3, "float32"))
        >>> opt = AdamW(learning_rate=0.1, weight_decay=0.0)
        >>> opt.apply([keras.ops.ones(3)], [w])
        >>> [round(float(x), 3) for x in keras.ops.convert_to_numpy(w)]
        [0.9, 0.9, 0.9]
    """

    def update_step(self, gradient, variable, learning_rate):
        import tensorflow as tf
        slots = None
        if (keras.backend.backend() == "tensorflow" and not self.amsgrad
                and not isinstance(gradient, tf.IndexedSlices)):
            slots = compat.adam_slots(self, variable)
        if slots is None:
            return super().update_step(gradient, variable, learning_rate)
        m, v = (s.value if isinstance(s, keras.Variable) else s for s in slots)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        return tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=m.handle, v=v.handle, beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step), lr=tf.cast(learning_rate, dtype), beta1=beta_1,
            beta2=beta_2, epsilon=tf.cast(self.epsilon, dtype), grad=tf.cast(gradient, dtype))


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
