"""What tfdist does to gradients once they are reduced over the replicas, where Keras 3 gets it
wrong under a strategy: tf.keras did both, Keras 3 does neither.

* `sum_duplicate_rows`: an embedding's gradient is an `IndexedSlices` with one row per token,
  and the all-reduce of one concatenates the replicas' rows, so a row appears once per replica
  that saw its token. Keras 3's Adam and AdamW square the rows one by one for their second
  moment (g1^2 + g2^2, not (g1 + g2)^2); tf.keras summed duplicates first
  (`_deduplicate_indexed_slices`), Keras 3 does not.
* `clip`: clipping by the global norm must see the reduced gradient. Keras 3 clips each replica's
  partial gradient by its own norm before its all-reduce, the pre-aggregation clipping that
  tf.keras refused to do (tensorflow/tensorflow#33929).
* `dense_if_smaller`: an `IndexedSlices` with at least as many rows as its variable is sent
  dense, which moves less (a byte GPT's embedding: 256 rows, not one per token).

Example:

    >>> import tensorflow as tf
    >>> from tfdist.parallel import gradients
    >>> g = tf.IndexedSlices(tf.ones((3, 2)), tf.constant([1, 0, 1]), tf.constant([4, 2]))
    >>> tf.convert_to_tensor(gradients.sum_duplicate_rows(g)).numpy().tolist()
    [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    >>> [float(x) for x in gradients.clip([tf.constant([3.0, 4.0])], 1.0)[0]]
    [0.6000000238418579, 0.800000011920929]
"""
from tfdist.runtime.lazy import tf


def sum_duplicate_rows(grad):
    """An `IndexedSlices` with each row once (duplicates summed); anything else as it is."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    unique, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, grad.dense_shape)


def dense_if_smaller(grad, variable):
    """`grad` as a dense tensor when it is an `IndexedSlices` of at least as many rows as
    `variable` has (statically known); else as it is."""
    if isinstance(grad, tf.IndexedSlices):
        rows = grad.indices.shape[0]
        if rows is not None and rows >= variable.shape[0]:
            return tf.convert_to_tensor(grad)
    return grad


def clip(grads, clipnorm, norm_sum=None, scale=None):
    """`grads` scaled down so that their global norm is at most `clipnorm` (0 or None: as they
    are). `norm_sum(x)`: x summed over the replicas, where each holds a shard of the gradients
    (ZeRO). `scale`: the loss scale the gradients still carry (mixed_float16), which scales the
    bound too; a gradient that overflowed makes the norm, and every gradient, non-finite, which
    the loss-scale optimizer then skips."""
    if not clipnorm:
        return list(grads)
    norm = None
    if norm_sum is not None:
        norm = tf.sqrt(norm_sum(tf.add_n(
            [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads])))
    limit = clipnorm if scale is None else clipnorm * scale
    clipped, _ = tf.clip_by_global_norm(grads, limit, use_norm=norm)
    return clipped


def reduce_and_correct(grads_and_vars, reduce, clipnorm=0.0):
    """What a user's compiled optimizer does with its gradients under a tfdist strategy
    (`tfdist.compat.set_gradient_reduction`): each sent dense where that moves less, reduced by
    `reduce(grads_and_vars)`, duplicate rows summed, then clipped by the reduced gradient's
    global norm. (tfdist's own step makes the same corrections: `tfdist.step`.)"""
    reduced = reduce([(dense_if_smaller(g, v), v) for g, v in grads_and_vars])
    grads = clip([sum_duplicate_rows(g) for g, _ in reduced], clipnorm)
    return list(zip(grads, [v for _, v in reduced]))
