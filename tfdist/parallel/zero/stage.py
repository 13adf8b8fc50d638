"""The interface every ZeRO stage implements: all that tfdist's training step asks of one.

tfdist's step (`tfdist.step`) calls, at each batch and each optimizer update, only what `Stage`
declares; each stage answers in its own way:

    sources()             what the loss is differentiated by
    build(optimizer)      the optimizer's slots, for what this replica updates
    accumulates(v)        whether this replica sums `v`'s gradients over a window (accumulation)
    batch_gradients(gv)   what this replica keeps of one batch's gradients
    update_gradients(gv)  the gradients of one update, reduced over the replicas
    norm_sum              sums a squared norm over the replicas, where each holds a share
    apply(opt, g, v)      the optimizer's update (offloaded: on the CPU, by sub-groups)
    after_update()        what follows the optimizer's update

`Stage` itself is stage 0: every replica holds every weight, slot and gradient, the strategy
all-reduces the gradients at each update, and nothing follows. The sharded stages extend it, each
the one before (`tfdist.parallel.zero.optimizer`: 1, 2; `tfdist.parallel.zero.weights`: 3).

Example (stage 0: the update's gradients are the strategy's reduction of the batch's):

    >>> import keras, numpy as np
    >>> from tfdist.parallel.zero.stage import Stage
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> stage = Stage(model, reduce=lambda gv: [(2 * g, v) for g, v in gv])
    >>> gv = stage.batch_gradients([(np.ones((2, 1), "float32"), model.weights[0])])
    >>> float(np.sum(stage.update_gradients(gv)[0][0]))
    4.0
"""
from tfdist.parallel import gradients


class Stage:
    """ZeRO stage 0 for `model`: the weights, the optimizer state and the gradients whole on
    every replica; `reduce(grads_and_vars)`: the strategy's reduction of the gradients over the
    replicas (`Strategy.reduce_gradients`)."""

    stage = 0
    #: Sums a squared norm over the replicas, where each holds a share of the gradient (clipping
    #: by the global norm); None: every replica holds the whole gradient.
    norm_sum = None

    def __init__(self, model, reduce):
        self.model, self.reduce = model, reduce

    @property
    def trainables(self):
        """The variables the optimizer updates here (what it is built with)."""
        return self.model.trainable_weights

    def sources(self):
        """What the loss is differentiated by, in the order of the gradients the step passes
        back (`batch_gradients`)."""
        return self.model.trainable_weights

    def build(self, optimizer):
        """Builds `optimizer`'s slots for `trainables`."""
        optimizer.build(self.trainables)

    def accumulates(self, variable):
        """Whether this replica sums `variable`'s gradients over the batches of an update's
        window (gradient accumulation): stages 0 and 1, every variable's local gradient."""
        return True

    def batch_gradients(self, grads_and_vars):
        """What this replica keeps of one batch's gradients ([(gradient, variable)] of
        `sources()`): what it accumulates, or applies when each batch is an update."""
        return list(grads_and_vars)

    def update_gradients(self, grads_and_vars):
        """The gradients of one update (`batch_gradients`' pairs, or their mean over the batches
        of an update), reduced over the replicas: what the optimizer applies here."""
        return self.reduce([(gradients.dense_if_smaller(g, v), v) for g, v in grads_and_vars])

    def apply(self, optimizer, grads, variables):
        """The optimizer's update of `variables` by `grads` (offloaded: on the CPU, sub-group by
        sub-group, `tfdist.parallel.zero.offload`)."""
        optimizer.apply(grads, variables)

    def after_update(self):
        """Runs after the optimizer's update (stages 1 and 2: the all-gather)."""
        return None  # (a body: AutoGraph cannot convert a function of a docstring alone)

    # -- what the rest of tfdist asks (backups, broadcasts, the log) ---------------------------
    #: ids of this replica's optimizer slots that no other replica has (its backup shard)
    slots = frozenset()
    #: ZeRO-Offload of this replica's state (a `tfdist.parallel.zero.offload.Offload`), or None
    offload = None

    def full_values(self):
        """The model's weights (`model.weights`' order), whole, as numpy arrays (ZeRO-3 gathers
        them: a collective, which every replica calls)."""
        return [w.numpy() for w in self.model.weights]

    def materialize(self):
        """Every weight whole in this replica's own variables, to save the model or read it
        (they are, but under ZeRO-3, which gathers them: a collective)."""

    def common(self, variables):
        """Those of `variables` (the model's, the optimizer's) that every replica holds alike:
        what a broadcast from one replica may set."""
        return list(variables)

    def describe(self):
        return "no ZeRO"
