"""tfdist: distributed training of TensorFlow/Keras 3 models with one strategy flag.

Example (2 replicas on 2 logical CPUs; any strategy of `tfdist.strategies.names()` works the same):

    >>> import keras, tensorflow as tf
    >>> import tfdist.models, tfdist.strategies
    >>> strategy = tfdist.strategies.get("mirrored", devices=2)
    >>> with strategy.scope():
    ...     model = tfdist.models.GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    ...     model.compile(optimizer=strategy.wrap_optimizer(keras.optimizers.AdamW()),
    ...                   loss=tfdist.models.loss_fn())
    >>> tokens = tf.random.stateless_uniform((8, 17), (0, 0), maxval=256, dtype=tf.int32)
    >>> dataset = tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()
    >>> history = strategy.fit(model, dataset, epochs=1, steps_per_epoch=3, verbose=0)
    >>> len(history.history["loss"])
    1
"""
__version__ = "0.1.0"

from tfdist.errors import UsageError  # noqa: F401
# The strategy registry (no TensorFlow: the plugins are read without it): the plugins' options
# join the config schema before any config is made.
from tfdist import strategies  # noqa: F401,E402
