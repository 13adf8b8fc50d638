"""tfdist: distributed training of TensorFlow/Keras 3 models with one strategy flag.

Example:

    import keras
    import tfdist.models, tfdist.strategies
    strategy = tfdist.strategies.get("mirrored", devices=2)
    with strategy.scope():
        model = tfdist.models.GPT(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)
        model.compile(optimizer=strategy.wrap_optimizer(keras.optimizers.AdamW()),
                      loss=tfdist.models.loss_fn())
    strategy.fit(model, dataset, epochs=1, steps_per_epoch=10)
"""
__version__ = "0.1.0"

from tfdist.errors import UsageError  # noqa: F401
