"""A Keras variable on the mesh: a DTensor variable in its storage layout, read in its compute
layout (`layouts`' docstring), written in its storage layout whatever the layout of the value.

Writes relayout their value first: DTensor assigns a value of another layout inside a
`tf.function` to some shards only (Adam's first step moved a replicated bias by 126 where one
device moved it by 0.001; measured here, TF 2.21).

A variable given a layout of its own (`keras.Variable(..., layout=...)`, and an optimizer's
slots, which take their weight's) is read in that layout as it is.

Example (after `tfdist.parallel.mesh.enable`, under a `ModelParallel` distribution, every Keras
variable a model creates is one):

    >>> from tfdist.parallel.mesh import variables
    >>> variables.mesh_variable_class().__mro__[1].__name__
    'DVariable'
"""
import functools

from tfdist.parallel.mesh import layouts
from tfdist.runtime.lazy import tf


@functools.cache
def mesh_variable_class():
    """`MeshVariable`: a DTensor variable whose writes are relayouted to its own layout."""
    class MeshVariable(layouts.dtensor().DVariable):
        compute_layout = None  # the layout a read takes (None: its own)

        def assign(self, value, *args, **kwargs):
            return super().assign(self._laid_out(value), *args, **kwargs)

        def assign_add(self, value, *args, **kwargs):
            return super().assign_add(self._laid_out(value), *args, **kwargs)

        def assign_sub(self, value, *args, **kwargs):
            return super().assign_sub(self._laid_out(value), *args, **kwargs)

        def _laid_out(self, value):
            return layouts.to_mesh(tf.cast(value, self.dtype), self.layout)

    return MeshVariable


def on_mesh(storage):
    return isinstance(storage, mesh_variable_class())


def create(variable, value, layout, explicit, batch_axis):
    """The storage of the Keras `variable` being made: a `MeshVariable` of `value` (a tensor, or a
    callable that makes one) in `layout` (a Keras `TensorLayout`), checked against its shape."""
    layouts.check_divides(variable.path, variable.shape, layout.axes,
                          layouts.sizes_of(layout.device_mesh))
    storage_layout = layouts.backend_layout(layout)
    with tf.init_scope():
        if callable(value):
            value = value()
        value = tf.convert_to_tensor(value, dtype=variable.dtype)
        storage = mesh_variable_class()(layouts.to_mesh(value, storage_layout),
                                        trainable=variable.trainable, name=variable.name)
    if not explicit:
        compute = layouts.compute_layout(storage_layout, batch_axis)
        storage.compute_layout = None if compute == storage_layout else compute
    return storage


def read(storage, tensor):
    """A read of a variable (`tensor`) in its compute layout."""
    if storage.compute_layout is None:
        return tensor
    return layouts.dtensor().relayout(tensor, storage.compute_layout)
