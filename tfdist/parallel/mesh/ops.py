"""The ops Keras's TF backend runs with a kernel DTensor cannot lay out, written with ops it can.

* `slice_update` (Keras's `ops.slice_update`; keras-hub's KV cache): Keras's is XLA's
  DynamicUpdateSlice, for which DTensor has "no layout propagation" (TF 2.21). Here: the update
  padded to the input's shape and selected by a padded mask, exact (no arithmetic on the
  values), with XLA's clamping of the start indices.

Example:

    >>> import numpy as np
    >>> from tfdist.parallel.mesh import ops
    >>> ops.slice_update(np.zeros((2, 4), "float32"), (0, 1), np.ones((2, 2), "float32")).numpy()
    array([[0., 1., 1., 0.],
           [0., 1., 1., 0.]], dtype=float32)
"""
from tfdist.runtime.lazy import tf


def slice_update(inputs, start_indices, updates):
    """`inputs` with `updates` written at `start_indices` (each clamped, as XLA does, so that the
    update fits)."""
    inputs = tf.convert_to_tensor(inputs)
    updates = tf.cast(updates, inputs.dtype)
    start = tf.cast(tf.stack([tf.cast(i, tf.int32) for i in start_indices]), tf.int32)
    room = tf.shape(inputs) - tf.shape(updates)
    start = tf.clip_by_value(start, 0, room)
    paddings = tf.stack([start, room - start], axis=1)
    placed = tf.pad(updates, paddings)
    mask = tf.pad(tf.ones_like(updates, tf.int8), paddings)
    return tf.where(mask > 0, placed, inputs)
