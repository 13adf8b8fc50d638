"""A drop-in for `horovod.tensorflow.keras` on Keras 3, built on tfdist's Horovod integration.

Horovod's own Keras layer breaks on Keras 3 (horovod/horovod#3725): its `DistributedOptimizer`
wraps a Keras 3 optimizer, trains, and never all-reduces, so the ranks drift apart silently;
`BroadcastGlobalVariablesCallback` fails on Keras 3 variables (`'Variable' object has no
attribute 'ref'`), and its other callbacks call `keras.backend.get_value`, gone in Keras 3. This
module has the same names and arguments for what Horovod's Keras examples use, so a script moves
by changing one line:

    import tfdist.horovod.keras as hvd          # was: import horovod.tensorflow.keras as hvd

* `init`, `shutdown`, `rank`, `size`, `local_rank`, `local_size`, `cross_rank`, `cross_size`,
  `is_initialized`, `Compression`, `Average`, `Sum`, `allreduce`, `allgather`, `broadcast`:
  Horovod's own (they work on tensors);
* `DistributedOptimizer`: the optimizer's gradient reduction becomes one grouped Horovod
  allreduce (`tfdist.strategies.horovod.allreduce_gradients`), with tfdist's Keras 3 corrections
  after it (`tfdist.compat.set_gradient_reduction`); `backward_passes_per_step` is Keras 3's
  `gradient_accumulation_steps`. It returns the same optimizer, adapted.
* `broadcast_variables` accepts Keras 3 variables; `load_model` loads and adapts the optimizer;
* `callbacks`: `BroadcastGlobalVariablesCallback`, `MetricAverageCallback`,
  `LearningRateScheduleCallback`, `LearningRateWarmupCallback`.

An argument that has no effect on Keras 3 is named in one line on stderr (rank 0); one that
cannot be honoured raises `ValueError` with one line.

Usage (not run as a doctest: inside a program started by `horovodrun -np 2 ...`):

    import keras, tensorflow as tf
    import tfdist.horovod.keras as hvd
    hvd.init()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="mse")
    ds = tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.ones((8, 1)))).repeat()
    model.fit(ds, steps_per_epoch=5, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
"""
import os

import keras
import tensorflow as tf

try:
    import horovod.tensorflow as _hvd
except ImportError as e:  # one line, as every tfdist error
    raise ImportError(f"tfdist.horovod.keras needs Horovod ({e}); "
                      f"build it with `make horovod`") from None

from horovod.tensorflow import (  # noqa: F401
    Average,
    Compression,
    Sum,
    allgather,
    allreduce,
    broadcast,
    cross_rank,
    cross_size,
    global_process_set,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

from tfdist import compat
from tfdist.horovod.keras.notes import note  # noqa: E402
from tfdist.parallel import gradients
from tfdist.strategies import horovod as _plugin


def init(*args, **kwargs):
    """Horovod's `init`. Horovod's background thread then wakes every 5 ms instead of 1 ms (the
    same as tfdist's horovod strategy: at 1 ms an idle rank spent most of a core polling);
    HOROVOD_CYCLE_TIME or horovodrun --cycle-time-ms wins."""
    os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")
    return _hvd.init(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Horovod's `DistributedOptimizer` for a Keras 3 optimizer: the gradients are reduced over
    the ranks (`op`, default the average) before every update. Returns `optimizer`, adapted."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"DistributedOptimizer needs a Keras 3 optimizer, got "
                         f"{type(optimizer).__name__}; build it with keras.optimizers")
    if op not in (Average, Sum):
        raise ValueError("DistributedOptimizer: only op=hvd.Average or hvd.Sum is supported "
                         "(Adasum is not, on Keras 3)")
    if process_set is not global_process_set:
        raise ValueError("DistributedOptimizer: only the global process set is supported")
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average (as in Horovod)")
    for arg, value, default in (("name", name, None), ("device_dense", device_dense, ""),
                                ("device_sparse", device_sparse, ""), ("num_groups", num_groups, 0),
                                ("groups", groups, None),
                                ("scale_local_gradients", scale_local_gradients, True)):
        if value != default:
            note(f"DistributedOptimizer({arg}={value!r}) has no effect on Keras 3 (tfdist reduces "
                 f"all gradients in one group on their own devices)")
    reduce_op = op
    prescale = 1.0
    postscale = 1.0
    if gradient_predivide_factor != 1.0:  # Horovod's split of the average around the sum
        reduce_op = Sum
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor / size()
    if backward_passes_per_step > 1:
        steps = optimizer.gradient_accumulation_steps
        if steps not in (None, backward_passes_per_step):
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} but the "
                             f"optimizer accumulates over gradient_accumulation_steps={steps}")
        if optimizer.built and not steps:
            raise ValueError("backward_passes_per_step > 1 needs an optimizer that is not built "
                             "yet: wrap it before compile/fit")
        optimizer.gradient_accumulation_steps = backward_passes_per_step
        if not average_aggregated_gradients:  # Keras 3 averages what it accumulated; Horovod sums
            postscale *= backward_passes_per_step

    def reduce(grads_and_vars):
        if sparse_as_dense:
            grads_and_vars = [(tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g, v)
                              for g, v in grads_and_vars]
        return _plugin.allreduce_gradients(_hvd, grads_and_vars, compression=compression,
                                           op=reduce_op, prescale_factor=prescale,
                                           postscale_factor=postscale)

    return compat.set_gradient_reduction(optimizer, reduce, gradients.reduce_and_correct)


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Horovod's `broadcast_variables`, also for Keras 3 variables."""
    if process_set is not global_process_set:
        raise ValueError("broadcast_variables: only the global process set is supported")
    _plugin.broadcast_variables(_hvd, variables, root_rank)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """Loads a saved Keras model and adapts its optimizer with `DistributedOptimizer`."""
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if model.optimizer is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model


# hvd.callbacks.* (uses the above) and hvd.elastic.*
from tfdist.horovod.keras import callbacks, elastic  # noqa: E402,F401
