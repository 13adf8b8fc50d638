"""Keras 3 optimizers (TF backend): how they reduce gradients, where they update, their schedule.
Each function names its row of the patch table (`tfdist/compat/table.py`)."""
import tensorflow as tf

from tfdist.compat.table import using
from tfdist.errors import UsageError


def set_gradient_reduction(optimizer, all_reduce=None, correct=None):
    """Sets how a user's compiled `optimizer` reduces gradients across replicas, once, and what
    tfdist corrects of what a Keras 3 optimizer does with them under a strategy
    ("gradient_reduction").

    `all_reduce(grads_and_vars) -> grads_and_vars` replaces Keras's own reduction (the strategy's
    collective); None keeps it. `correct(grads_and_vars, reduce, clipnorm) -> grads_and_vars`
    reduces with `reduce` and corrects the result, clipping by `global_clipnorm`, which Keras
    would apply to each replica's partial gradient before the all-reduce (tfdist's:
    `tfdist.parallel.gradients.reduce_and_correct`); None: only the reduction. One reduction, one
    correction: a second call raises instead of wrapping twice. (tfdist's GPT does all this in
    its training step instead: `tfdist.step`.)"""
    if has_gradient_reduction(optimizer):
        raise ValueError("the optimizer's gradient reduction is already set (wrap it once)")
    reduce = all_reduce or optimizer._all_reduce_sum_gradients
    optimizer.tfdist_reduction = True
    if not using("gradient_reduction") or correct is None:
        if all_reduce:
            optimizer._all_reduce_sum_gradients = all_reduce
        return optimizer
    clipnorm = optimizer.global_clipnorm
    optimizer.global_clipnorm = None
    optimizer._all_reduce_sum_gradients = lambda grads_and_vars: correct(grads_and_vars, reduce,
                                                                         clipnorm)
    return optimizer


def has_gradient_reduction(optimizer):
    """Whether the optimizer's reduction is tfdist's already (`set_gradient_reduction` or
    `reduce_nothing_in_apply`)."""
    return getattr(optimizer, "tfdist_reduction", False)


def reduce_nothing_in_apply(optimizer):
    """Keras's `apply` without its own all-reduce ("no_second_reduction"): tfdist's training
    step hands it gradients already reduced over the replicas. (A loss-scale optimizer's inner
    optimizer does the update, so its reduction is the one switched off.)"""
    optimizer.tfdist_reduction = True
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner.tfdist_reduction = True
    if using("no_second_reduction"):
        inner._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)
    return optimizer


def update_on_variable_device(optimizer):
    """Runs each variable's optimizer update on that variable's device
    ("update_on_variable_device"): Keras 3 (TF backend, default strategy) leaves the update math
    without a device, so TF would run every pipeline stage's updates on the first device and copy
    gradients back and forth. (Public API: `update_step`, wrapped on this optimizer.)"""
    if getattr(optimizer, "tfdist_placed", False) or not using("update_on_variable_device"):
        return
    update_step = optimizer.update_step

    def placed(gradient, variable, learning_rate):
        with tf.device(variable.device):
            return update_step(gradient, variable, learning_rate)

    optimizer.update_step = placed
    optimizer.tfdist_placed = True


def adam_slots(optimizer, variable):
    """(first moment, second moment) of `variable` in Keras's Adam family ("adam_slots": Keras 3
    keeps them in private lists, by the variable's private index); None when the row is off."""
    if not using("adam_slots"):
        return None
    i = optimizer._get_variable_index(variable)
    return optimizer._momentums[i], optimizer._velocities[i]


def learning_rate_schedule(optimizer):
    """The optimizer's learning-rate schedule, or its float rate ("learning_rate_schedule":
    `optimizer.learning_rate` is only the current value)."""
    using("learning_rate_schedule")
    return optimizer._learning_rate


def set_learning_rate_schedule(optimizer, schedule):
    using("learning_rate_schedule")
    optimizer._learning_rate = schedule


def optimizer_strategy(optimizer):
    """The tf.distribute strategy a Keras 3 optimizer was created (and creates variables) under
    ("optimizer_strategy")."""
    using("optimizer_strategy")
    return optimizer._distribution_strategy


def local_variables(strategy):
    """A scope where variables made under `strategy` (MirroredStrategy's family) are plain ones on
    this process's first device, not mirrored ones the workers initialise by a collective
    broadcast ("local_variables": ZeRO's slot shards differ per worker). TF 2.21 skips mirroring
    only for `colocate_with=numpy_dataset.SingleDevice`, which this sets after Keras's own."""
    using("local_variables")
    from tensorflow.python.distribute.numpy_dataset import SingleDevice
    device = SingleDevice(strategy.extended.worker_devices[0])
    return tf.variable_creator_scope(lambda next_creator, **kwargs: next_creator(
        **{**kwargs, "colocate_with": device}))



def uses_weight_decay(optimizer, variable):
    """Whether `optimizer` decays `variable`'s weight ("weight_decay_choice": Keras 3 decides by
    the lists and patterns given to `exclude_from_weight_decay`, and has no public query)."""
    if optimizer.weight_decay is None:
        return False
    if not using("weight_decay_choice"):  # (switched off: every variable decays)
        return True
    if variable._value is not None:
        return optimizer._use_weight_decay(variable)
    # (a weight without storage, ZeRO-3's offloaded: its name decides; a list of variables
    # given to exclude_from_weight_decay is kept by their storage's ids, which it lacks)
    if getattr(optimizer, "_exclude_from_weight_decay", None):
        raise UsageError(f"the optimizer's exclude_from_weight_decay(var_list=...) cannot be "
                         f"told for {variable.path}, whose storage is offloaded (ZeRO-3); "
                         f"exclude by var_names instead")
    pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    return not (pattern is not None and pattern.search(variable.name))
