"""Keras methods follow the strategy ("keras_methods_follow_the_strategy"): a user's `compile`,
`fit`, `evaluate`, `predict` and `save` go to the tfdist plugin that owns the model. Its row of
the patch table: `tfdist/compat/table.py`."""
import functools
import inspect
import threading

import keras
from keras.src.backend.tensorflow import trainer as _tf_trainer
from keras.src.trainers import trainer as _trainer

from tfdist.compat.table import using

_UPSTREAM = {"compile": _trainer.Trainer.compile,  # Keras's own
             "fit": _tf_trainer.TensorFlowTrainer.fit,
             "evaluate": _tf_trainer.TensorFlowTrainer.evaluate,
             "predict": _tf_trainer.TensorFlowTrainer.predict,
             "save": keras.Model.save}
_inside = threading.local()


def route_keras(owner_of):
    """Routes Keras 3 `compile`, `fit`, `evaluate`, `predict` and `Model.save` of a model to the
    tfdist strategy plugin that owns it.

    Keras 3 has no hook through which a strategy adapts them: `fit` has no ParameterServerStrategy
    path (keras-team/keras#18624), and Horovod, no tf.distribute strategy, has no way to
    all-reduce gradients or split input. `compile` asks `owner_of(model, compiling=True)` (the
    plugin then adopts the model: `before_compile`, Keras's compile, `after_compile`); the others
    go to `owner_of(model).keras_call(method, model, upstream, arguments)` (arguments bound by
    name; `upstream` is Keras's own), or to Keras's own without an owner. Idempotent. Calls Keras
    makes itself (fit's validation) and calls from inside a `keras_call` go to Keras's own.
    """
    if _trainer.Trainer.compile is not _UPSTREAM["compile"]:
        return
    if not using("keras_methods_follow_the_strategy"):
        return

    @functools.wraps(_UPSTREAM["compile"])  # keeps Keras's `_is_default` marks, which saving reads
    def compile(self, *args, **kwargs):
        owner = owner_of(self, compiling=True)
        if owner is not None:
            arguments = _bind("compile", self, args, kwargs)
            owner.before_compile(self, arguments)
            _UPSTREAM["compile"](self, **arguments)
            owner.after_compile(self)
            return
        _UPSTREAM["compile"](self, *args, **kwargs)

    def routed(method):
        @functools.wraps(_UPSTREAM[method])
        def call(self, *args, **kwargs):
            # (Keras's own nested calls, fit's validation, run as they are; a `save` inside `fit`,
            # a user's callback's, is routed: on every rank it wrote the one file at once)
            inside = getattr(_inside, "active", False) and method != "save"
            owner = None if kwargs.get("_use_cached_eval_dataset") or inside else owner_of(self)
            if owner is None:
                return _UPSTREAM[method](self, *args, **kwargs)
            arguments = _bind(method, self, args, kwargs)
            _inside.active = True
            try:
                return owner.keras_call(method, self, _UPSTREAM[method], arguments)
            finally:
                _inside.active = False
        return call

    # Trainer's: Keras compiles a loaded model only when `compile` is Trainer's own
    _trainer.Trainer.compile = compile
    for method in ("fit", "evaluate", "predict"):
        setattr(_tf_trainer.TensorFlowTrainer, method, routed(method))
    keras.Model.save = routed("save")


def _bind(method, model, args, kwargs):
    """The call's arguments by name (defaults included), as Keras's own method takes them."""
    bound = inspect.signature(_UPSTREAM[method]).bind(model, *args, **kwargs)
    bound.apply_defaults()
    arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


def keras_method(name):
    """Keras's own `fit`/`evaluate`/`predict`/`compile`/`save`, as if tfdist had not routed it."""
    return _UPSTREAM[name]
