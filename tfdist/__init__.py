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
import importlib.abc
import sys

from tfdist.errors import Moved, UsageError  # noqa: F401

__version__ = "0.2.0"

#: Modules that moved when the package took its folders (docs/design.md): an import of the old
#: name is one line naming the new one (`tfdist.errors.Moved`; a program's uncaught error is that
#: line and exit status 2).
MOVED = {
    "tfdist.buckets": "tfdist.parallel.buckets",
    "tfdist.gradients": "tfdist.parallel.gradients",
    "tfdist.layout": "tfdist.parallel.layout",
    "tfdist.zero": "tfdist.parallel.zero",
    "tfdist.zero3": "tfdist.parallel.zero (its stage 3: tfdist.parallel.zero.weights)",
    "tfdist.zero3_scope": "tfdist.parallel.zero.weights",
    "tfdist.cluster": "tfdist.runtime.cluster",
    "tfdist.console": "tfdist.runtime.console",
    "tfdist.early": "tfdist.runtime.early",
    "tfdist.host": "tfdist.runtime.cpu",
    "tfdist.lazy": "tfdist.runtime.lazy",
    "tfdist.lock": "tfdist.runtime.lock",
    "tfdist.preemption": "tfdist.runtime.preemption",
    "tfdist.profiling": "tfdist.runtime.profiling",
    "tfdist.progress": "tfdist.runtime.progress",
    "tfdist.prepare": "tfdist.cli.prepare",
    "tfdist.sample": "tfdist.cli.sample",
    "tfdist.data.prepare": "tfdist.data.build",
    "tfdist.launch.cli": "tfdist.cli.launch",
    "tfdist.launch.serve": "tfdist.cli.serve",
    "tfdist.plan.cli": "tfdist.cli.plan",
    "tfdist.plan.__main__": "the command `tfdist plan`",
}


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Asked last, for a module no other finder found: a moved one raises `Moved`."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            raise Moved(name, MOVED[name])
        return None


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())

# The strategy registry (no TensorFlow: the plugins are read without it): the plugins' options
# join the config schema before any config is made.
from tfdist import strategies  # noqa: F401,E402
