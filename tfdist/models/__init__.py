"""Models. `GPT` is the Keras 3 GPT; `pipeline` splits it into stages; `arithmetic` counts its
parameters, FLOPs and bytes from its sizes alone. `GPT` and `loss_fn` are imported on first use,
so that `tfdist.models.arithmetic` (and `tfdist plan`) load without TensorFlow."""


def __getattr__(name):  # PEP 562: `from tfdist.models import GPT` still works
    if name in ("GPT", "loss_fn"):
        from tfdist.models import gpt
        return getattr(gpt, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
