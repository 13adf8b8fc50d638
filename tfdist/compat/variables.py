"""A Keras variable without its storage, and with it again: ZeRO-3's sharded weights
(`tfdist.parallel.zero.weights`). Keras 3 has no public way to drop a variable's value on the TF
backend: its `keras.distribution` shards variables on JAX only (keras-team/keras#18473, open)."""
from tfdist.compat.table import using


def storage(variable):
    """The backend variable behind a Keras variable (read it to bypass Keras's stateless scope):
    "parameter_storage"."""
    using("parameter_storage")
    return variable._value


def has_storage(variable):
    using("parameter_storage")
    return variable._value is not None


def release_storage(variable, why=None):
    """Drops `variable`'s storage: its value lives elsewhere (another replica). Keras's own read
    of a variable without a value returns its initializer's (for shape inference); here such a
    read is an error that says `why`."""
    using("parameter_storage")
    message = why or f"the weight {variable.path} is held by another replica (ZeRO-3)"

    def refuse(shape, dtype=None):
        raise ValueError(message)
    variable._value = None
    variable._initializer = refuse


def restore_storage(variable, value):
    """Gives `variable` storage again, holding `value`: a variable of this process (outside a
    strategy's scope; inside, a distributed variable, which multi_worker_mirrored would
    broadcast from worker 0)."""
    using("parameter_storage")
    variable._initializer = None
    variable._initialize(value)


def make_stageable(variable):
    """Gives `variable` a storage of any shape, empty now ("staged_storage"): ZeRO-Offload's
    step fills it with a sub-group's values (`fill_storage`), updates it, and empties it
    (`empty_storage`), so that a variable holds its value only while it is updated. The TF
    variable stays the same object, so that Keras's optimizer, which knows each variable by its
    TF variable's id, keeps knowing it."""
    import tensorflow as tf
    if not using("staged_storage"):  # (switched off: the value stays whole, in memory)
        return
    old = variable._value
    variable._value = tf.Variable(tf.zeros([0], old.dtype), shape=tf.TensorShape(None),
                                  trainable=old.trainable, name=old.name.split(":")[0])


def fill_storage(variable, value):
    if using("staged_storage"):
        variable._value.assign(value)
    else:
        variable.assign(value)


def empty_storage(variable):
    import tensorflow as tf
    if using("staged_storage"):
        variable._value.assign(tf.zeros([0], variable._value.dtype))
