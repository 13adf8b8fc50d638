"""Keras's `fit`, `evaluate` and `predict` on the mesh: each batch laid out on it, and the
training step in two DTensor functions.

1. **The batch**, as it leaves Keras's iterator (outside any `tf.function`), goes onto the mesh
   in the distribution's data layout: its first dimension sharded over the batch axis. Every
   process reads the same global batch and keeps its own shards (so every process must read the
   batches in the same order: pass `shuffle=False`, or seed Keras's shuffle the same way).
2. **The gradients**: the model's own `train_step` (forward, loss, gradients, metrics) in one
   function, its optimizer's `apply` held back; the gradients come out in their variables'
   storage layouts. DTensor's SPMD expansion has already summed them over the batch axis: the
   optimizer's own all-reduce is switched off.
3. **The update**: the optimizer's `apply`, in a second function. In one function with the
   forward pass, DTensor lost the order of a variable's write and a later read of it: Adam read
   its moments as zero and no weight moved (TF 2.21, measured here). For the same reason a
   step's logs read its metrics again after it (`fresh`).

Example (what a batch of 8 looks like on a (2, 2) mesh: each device holds 4 rows):

    >>> from tfdist.parallel.mesh import step
    >>> step.rows_per_device(8, {"batch": 2, "model": 2}, "batch")
    4
"""
import contextlib
import itertools
import sys

from tfdist import compat
from tfdist.errors import UsageError
from tfdist.parallel.mesh import layouts
from tfdist.runtime.lazy import keras, tf


def rows_per_device(batch, sizes, batch_axis):
    """The rows of a batch each device holds; one line when the batch axis does not divide it."""
    n = sizes.get(batch_axis, 1)
    if batch % n:
        raise UsageError(f"a batch of {batch} rows does not split over the mesh's batch axis "
                         f"{batch_axis!r} ({n} devices): give a batch size (and a number of "
                         f"samples) divisible by {n}")
    return batch // n


def onto_mesh(data):
    """A batch (nested tensors) on the mesh, in the distribution's data layout."""
    distribution = keras.distribution.distribution()
    sizes = layouts.sizes_of(distribution.device_mesh)

    def place(value):
        if value is None:
            return None
        value = tf.convert_to_tensor(value)
        layout = distribution.get_data_layout(value.shape)
        if value.shape.rank:
            rows_per_device(value.shape[0], sizes, distribution.batch_dim_name)
        return layouts.to_mesh(value, layouts.backend_layout(layout))
    return tf.nest.map_structure(place, data)


def refuse_unsupported(model):
    """One line for a model DTensor cannot run: tfdist's GPT of architecture "gpt2" (its step on a
    mesh, even with every weight whole, crashed the process or failed with an undecodable error,
    TF 2.21; its architecture "llama" runs)."""
    from tfdist.models.gpt import GPT
    if isinstance(model, GPT) and model.arch == "gpt2":
        raise UsageError("tfdist's GPT of architecture gpt2 does not run on a DTensor mesh (TF "
                         "2.21 crashes in its step); use arch='llama' there, or tfdist's own "
                         "tensor parallelism (--config.tensor.parallel) for GPT-2")


def batches(model, iterator, ready=None):
    """Keras's batches on the mesh; before the first of a function's (`ready`: its state, None:
    every time) the model is checked and built (loss, metrics, optimizer) from that batch, before
    any step runs."""
    iterator = iter(iterator)
    if ready is not None and ready.get("model"):
        yield from map(onto_mesh, iterator)
        return
    refuse_unsupported(model)
    try:
        first = next(iterator)
    except StopIteration:
        return
    compat.symbolic_build(model, first)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
        say_if_whole(model)
    if ready is not None:
        ready["model"] = True
    yield from map(onto_mesh, itertools.chain([first], iterator))


@contextlib.contextmanager
def held_back(optimizer, out):
    """The optimizer's `apply(grads, variables)` records its arguments into `out` instead."""
    def record(grads, trainable_variables=None):
        out.append((list(grads), trainable_variables))
    optimizer.apply = record
    try:
        yield
    finally:
        del optimizer.apply


def dense_in(grad, variable):
    """A gradient in its variable's storage layout (an embedding's `IndexedSlices` made dense:
    DTensor lays out dense tensors)."""
    if grad is None:
        return None
    storage = variable.value
    return layouts.dtensor().relayout(tf.convert_to_tensor(grad), storage.layout)


def fresh(model, logs):
    """A step's logs, whole on this process, its metrics read again after the step: inside the
    step's function DTensor reads a metric's variables as they were before the step's own update
    (the same lost order as the update's; the loss logged 0.0 at every step)."""
    if isinstance(logs, dict):
        logs = {**logs, **model.get_metrics_result()}
    return tf.nest.map_structure(layouts.to_local, logs)


def say_if_whole(model):
    """One line when a `ModelParallel` layout map matched none of the model's weights (each is
    then whole on every device: what Keras does, on any backend)."""
    distribution = keras.distribution.distribution()
    if not isinstance(distribution, keras.distribution.ModelParallel):
        return
    d = layouts.dtensor()
    if all(spec == d.UNSHARDED for v in model.weights for spec in v.value.layout.sharding_specs):
        print(f"tfdist: warning: the LayoutMap matched none of the model's {len(model.weights)} "
              f"weights: each is whole on every device (their paths: model.weights[i].path)",
              file=sys.stderr, flush=True)


def train_function(model):
    """Keras's train function for a model on the mesh (see the module's docstring)."""
    if not compat.has_gradient_reduction(model.optimizer):
        compat.reduce_nothing_in_apply(model.optimizer)
    held = {}

    @tf.function
    def gradients(data):
        out = []
        with held_back(model.optimizer, out):
            logs = model.train_step(data)
        if len(out) != 1:
            raise UsageError(f"the model's train_step called optimizer.apply {len(out)} times; "
                             f"on a mesh tfdist runs it once per step")
        grads, variables = out[0]
        variables = list(variables if variables is not None else model.trainable_variables)
        held["variables"] = variables
        return logs, [dense_in(g, v) for g, v in zip(grads, variables)]

    @tf.function
    def update(grads):
        model.optimizer.apply(grads, held["variables"])

    ready = {}

    def function(iterator):
        logs = None
        for _, data in zip(range(model.steps_per_execution), batches(model, iterator, ready)):
            logs, grads = gradients(data)
            update(grads)
        if logs is None:
            raise StopIteration
        return fresh(model, logs)
    return function


def test_function(model, keras_function):
    """Keras's test function, fed batches on the mesh."""
    ready = {}

    def function(iterator):
        return fresh(model, keras_function(batches(model, iterator, ready)))
    return function


def predict_function(model, keras_function):
    """Keras's predict function, fed batches on the mesh; its outputs whole on this process."""
    def function(data):
        out = keras_function([onto_mesh(batch) for batch in data])
        return tf.nest.map_structure(layouts.to_local, out)
    return function


def generate_function(model, keras_function):
    """keras-hub's generate function, fed prompts on the mesh, whole on every device (its loop
    builds masks of a shape known only as it runs, which DTensor cannot split over the batch
    axis: "EmitAllScatter requires slice on input axis 0 which is dynamic"); its outputs whole
    on this process."""
    def function(inputs, *args, **kwargs):
        mesh = layouts.backend_mesh(keras.distribution.distribution().device_mesh)
        whole = tf.nest.map_structure(
            lambda t: layouts.to_mesh(t, layouts.replicated(mesh, len(t.shape))), inputs)
        out = keras_function(whole, *args, **kwargs)
        return tf.nest.map_structure(layouts.to_local, out)
    return function
