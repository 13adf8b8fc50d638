"""The training step of tfdist's GPT, top to bottom.

Keras's `fit` drives training (callbacks, the progress, the backup); for tfdist's GPT each of its
steps is this one, which `TrainStep` sets as the model's `train_step` (the documented place to
change what `fit` does). `__call__` takes one batch:

1. forward, loss and gradients: a model laid out over devices (`tfdist.models.pipeline`) runs
   its pipeline schedule (GPipe or 1F1B), each backward op on its stage's device; a whole GPT, one
   gradient tape;
2. Keras's `loss` metric, which the logs and the progress show;
3. `update(grads)`.

`update` takes the gradients of one batch:

1. accumulation (`train.grad_accum_steps`): the batch's gradients are added to accumulators and
   only every k-th batch goes on, with their mean (ZeRO-2 reduce-scatters first, so that it
   accumulates only its 1/N);
2. the strategy's reduction: each gradient summed (or averaged) over the replicas, in buckets
   that start while the backward pass runs (`Strategy.reduce_gradients`); under ZeRO a
   reduce-scatter instead, each replica receiving its own variables' (`tfdist.zero`);
3. the Keras 3 corrections, after the reduction (`tfdist.gradients`): duplicated embedding rows
   summed, then clipping by the global norm of the reduced gradient;
4. the optimizer's update, with its own all-reduce switched off: the gradients are reduced;
5. under ZeRO, every replica's updated variables to every replica.

Each parallel axis plugs in here through its own module: the pipeline's schedule, the
strategy's collective, ZeRO's shard. A user's own Keras model keeps Keras's `train_step` and
gets the reduction and corrections inside its optimizer instead (`Strategy.wrap_optimizer`).

Example (one device: the step of a plain GPT, with clipping and 2 batches per update):

    >>> import keras, tensorflow as tf, tfdist.strategies
    >>> from tfdist.layout import Layout
    >>> from tfdist.models.gpt import GPT, loss_fn
    >>> from tfdist.step import TrainStep
    >>> strategy = tfdist.strategies.get("single")
    >>> with strategy.scope():
    ...     model = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
    ...     model.build()
    ...     model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=loss_fn())
    ...     step = TrainStep(model, strategy, Layout(accumulate=2), clipnorm=1.0)
    >>> tokens = tf.random.stateless_uniform((8, 17), (0, 0), maxval=256, dtype=tf.int32)
    >>> data = tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()
    >>> history = model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
    >>> int(model.optimizer.iterations.numpy())  # 4 batches, 2 per update
    2
"""
from tfdist import compat, gradients
from tfdist.lazy import keras, tf


class TrainStep:
    """The step of `model` (compiled, built; a GPT or its `Pipeline`) under `strategy` (a tfdist
    plugin), for `layout` (a `tfdist.layout.Layout`: its accumulation, ZeRO stage, split).
    `clipnorm`: the bound of the gradients' global norm (0: none). `reduce(grads_and_vars)`:
    the reduction (default: the strategy's). `collectives`: ZeRO's (default: the strategy's).
    Create it inside `strategy.scope()`: it builds the optimizer (and its accumulators)."""

    def __init__(self, model, strategy, layout, clipnorm=0.0, reduce=None, collectives=None):
        self.model, self.layout, self.clipnorm = model, layout, clipnorm
        self.optimizer = optimizer = strategy.prepared(model.optimizer)
        self.reduce = reduce or strategy.reduce_gradients
        # The gradients are reduced here: Keras's optimizer must not all-reduce them again.
        compat.reduce_nothing_in_apply(optimizer)
        if layout.split:  # each variable's update on its device (Keras 3 leaves it unplaced)
            compat.update_on_variable_device(optimizer)
        self.zero = self.params = None
        if layout.zero:
            from tfdist import zero, zero3
            collectives = collectives or strategy.zero_collectives()
            if layout.zero == 3:  # the weights too: each unit gathered where it runs
                self.params = zero3.shard(model, collectives)
            self.zero = zero.shard(optimizer, layout.zero, collectives,
                                   self.params and self.params.owner)
            self.zero.params = self.params
        variables = model.trainable_weights
        # (under ZeRO: this replica's slots only; ZeRO-3: built on the weights it holds)
        optimizer.build(self.params.owned if self.params else variables)
        self.accumulators = []
        if layout.accumulate > 1:  # ZeRO-2, 3 keep only their own variables' (None for others)
            add = self.zero.add_slot if self.zero and layout.zero >= 2 else \
                optimizer.add_variable_from_reference
            self.accumulators = [add(v, name="gradient_accumulator") for v in variables]
            self.batches = optimizer.add_variable((), dtype="int64", name="tfdist_batches")
        model.train_step = self  # what Keras's fit calls for each batch

    def __call__(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        model, optimizer = self.model, self.optimizer
        y_pred = None
        # 1. Forward, loss, gradients (of the loss scaled for mixed_float16, if it is); ZeRO-3:
        #    by this replica's own weights, reduce-scattered by the backward pass.
        variables = self.params.sources() if self.params else model.trainable_weights
        if self.layout.split:  # the pipeline's schedule; tf.gradients, placed stage by stage
            loss, grads = model.compute_gradients(x, y, scale=optimizer.scale_loss,
                                                  variables=variables)
        else:
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x, y, y_pred, sample_weight, training=True)
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, variables)
        # 2. Keras's `loss` metric, as its own train_step keeps it.
        compat.track_loss(model, loss, tf.shape(tf.nest.flatten(x)[0])[0])
        # 3. Reduce, correct, apply. (ZeRO-3: the anchor's gradient is kept, so that a replica
        #    that owns none of a unit's weights runs the unit's reduce-scatter too.)
        if self.params:
            self.params.keep(grads[-1])
        self.update(list(zip(grads, variables)))
        if y_pred is None:
            return model.get_metrics_result()
        return model.compute_metrics(x, y, y_pred, sample_weight)  # a user's compiled metrics

    def update(self, grads_and_vars):
        """Accumulates, reduces, corrects and applies one batch's gradients (the module doc)."""
        zero, k = self.zero, self.layout.accumulate
        # 1. Accumulation: every k-th batch goes on, with the mean of the k batches' gradients.
        if k > 1:
            if zero and zero.stage >= 2:  # each replica accumulates its own variables' only
                grads_and_vars = zero.reduce_scatter(grads_and_vars)
            owned = {id(v) for _, v in grads_and_vars}
            pairs = [(a, v) for a, v in zip(self.accumulators, self.model.trainable_weights)
                     if a is not None and id(v) in owned]
            grads = dict((id(v), g) for g, v in grads_and_vars)
            for a, v in pairs:
                a.assign_add(tf.convert_to_tensor(grads[id(v)]))
            self.batches.assign_add(1)

            def mean_and_reset():
                mean = [(tf.convert_to_tensor(a) / k, v) for a, v in pairs]
                with tf.control_dependencies([g for g, _ in mean]):
                    self._apply(mean, reduced=bool(zero and zero.stage >= 2))
                    for a, _ in pairs:
                        a.assign(tf.zeros_like(a))
                return tf.constant(0)
            tf.cond(self.batches % k == 0, mean_and_reset, lambda: tf.constant(0))
            return
        self._apply(grads_and_vars, reduced=False)

    def _apply(self, grads_and_vars, reduced):
        optimizer, zero = self.optimizer, self.zero
        # 2. The strategy's reduction (ZeRO: reduce-scatter, to this replica's variables).
        if zero and not reduced:
            grads_and_vars = zero.reduce_scatter(grads_and_vars)
        elif not zero:
            grads_and_vars = self.reduce(
                [(gradients.dense_if_smaller(g, v), v) for g, v in grads_and_vars])
        # 3. Keras 3 corrections, on the reduced gradients: duplicate embedding rows summed (Adam
        #    squares each), then clipping by their global norm (tensorflow/tensorflow#33929).
        grads = [gradients.sum_duplicate_rows(g) for g, _ in grads_and_vars]
        scale = optimizer.scale_loss(tf.constant(1.0)) if isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer) else None
        grads = gradients.clip(grads, self.clipnorm, zero and zero.norm_sum, scale)
        # 4. The update (its own all-reduce off: `compat.reduce_nothing_in_apply`).
        optimizer.apply(grads, [v for _, v in grads_and_vars])
        # 5. ZeRO: each replica's updated variables to every replica.
        if zero:
            zero.gather()
