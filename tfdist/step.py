"""The training step of tfdist's GPT, top to bottom.

Keras's `fit` drives training (callbacks, the progress, the backup); for tfdist's GPT each of its
steps is this one, set as the model's `train_step` (the documented place to change what `fit`
does): `model.train_step = TrainStep(...)`. `__call__` takes one batch:

1. forward, loss and gradients: a model laid out over devices (`tfdist.models.pipeline`) runs
   its pipeline schedule (GPipe or 1F1B), each backward op on its stage's device; a whole GPT, one
   gradient tape; in both, by what the ZeRO stage says (`sources`: under ZeRO-3 the weights this
   replica holds, whose gradients the backward pass reduce-scatters);
2. Keras's `loss` metric, which the logs and the progress show;
3. `update(grads)`.

`update` takes the gradients of one batch:

1. what this replica keeps of them (the ZeRO stage's `batch_gradients`: all of them, or under
   ZeRO-2 its own share, reduce-scattered at once);
2. accumulation (`train.grad_accum_steps`): they are added to accumulators and only every k-th
   batch goes on, with their mean;
3. the reduction over the replicas (the stage's `update_gradients`: the strategy's all-reduce, in
   buckets that start while the backward pass runs, or ZeRO-1's reduce-scatter);
4. the Keras 3 corrections, after the reduction (`tfdist.parallel.gradients`): duplicated
   embedding rows summed, then clipping by the global norm of the reduced gradient (each replica
   holding a share under ZeRO: the stage's `norm_sum`);
5. the optimizer's update, with its own all-reduce switched off: the gradients are reduced;
6. what follows it (the stage's `after_update`: ZeRO-1 and 2 all-gather the updated weights).

Each parallel axis plugs in here through its own module: the pipeline's schedule, the
strategy's collective, the ZeRO stage (`tfdist.parallel.zero`, whose interface is all the step
asks of it). A user's own Keras model keeps Keras's `train_step` and gets the reduction and
corrections inside its optimizer instead (`Strategy.wrap_optimizer`); under ZeRO-3 it takes this
step too (`tfdist.strategies.keras_program`).

Example (one device: the step of a plain GPT, with clipping and 2 batches per update):

    >>> import keras, tensorflow as tf, tfdist.strategies
    >>> from tfdist.parallel.layout import Layout
    >>> from tfdist.models.gpt import GPT, loss_fn
    >>> from tfdist.step import TrainStep
    >>> strategy = tfdist.strategies.get("single")
    >>> with strategy.scope():
    ...     model = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
    ...     model.build()
    ...     model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=loss_fn())
    ...     model.train_step = TrainStep(model, strategy, Layout(accumulate=2), clipnorm=1.0)
    >>> tokens = tf.random.stateless_uniform((8, 17), (0, 0), maxval=256, dtype=tf.int32)
    >>> data = tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()
    >>> history = model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
    >>> int(model.optimizer.iterations.numpy())  # 4 batches, 2 per update
    2
"""
from tfdist import compat
from tfdist.parallel import gradients, zero
from tfdist.runtime.lazy import keras, tf


class TrainStep:
    """The step of `model` (compiled, built; a GPT or its `Pipeline`, or a user's model under
    ZeRO-3) under `strategy` (a tfdist plugin), for `layout` (a `tfdist.parallel.layout.Layout`:
    its accumulation, ZeRO stage, split). `clipnorm`: the bound of the gradients' global norm (0:
    none). `reduce(grads_and_vars)`: the reduction without ZeRO (default: the strategy's).
    `collectives`: ZeRO's (default: the strategy's). `zero_options`: the ZeRO stage's
    (`tfdist.parallel.zero.make`; a fault test's `skip`). Create it inside `strategy.scope()`: it
    builds the optimizer (and its accumulators). Set it as `model.train_step`."""

    def __init__(self, model, strategy, layout, clipnorm=0.0, reduce=None, collectives=None,
                 zero_options=None):
        self.model, self.layout = model, layout
        self.clipnorm = clipnorm
        self.optimizer = optimizer = strategy.prepared(model.optimizer)
        # The gradients are reduced here: Keras's optimizer must not all-reduce them again.
        compat.reduce_nothing_in_apply(optimizer)
        if layout.split:  # each variable's update on its device (Keras 3 leaves it unplaced)
            compat.update_on_variable_device(optimizer)
        if layout.zero and collectives is None:
            collectives = strategy.zero_collectives()
        self.zero = zero.make(layout.zero, model, collectives,
                              reduce or strategy.reduce_gradients, **(zero_options or {}))
        self.zero.build(optimizer)  # (under ZeRO: this replica's slots only)
        self.accumulators = []
        if layout.accumulate > 1:  # (None for a variable whose accumulator another replica keeps)
            self.accumulators = [self.zero.accumulator(v, optimizer)
                                 for v in model.trainable_weights]
            self.batches = optimizer.add_variable((), dtype="int64", name="tfdist_batches")

    def __call__(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        model, optimizer = self.model, self.optimizer
        y_pred = None
        # 1. Forward, loss, gradients (of the loss scaled for mixed_float16, if it is).
        variables = self.zero.sources()
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
        # 3. Accumulate, reduce, correct, apply.
        self.update(list(zip(grads, variables)))
        if y_pred is None:
            return model.get_metrics_result()
        return model.compute_metrics(x, y, y_pred, sample_weight)  # a user's compiled metrics

    def update(self, grads_and_vars):
        """Keeps, accumulates, reduces, corrects and applies one batch's gradients (the module
        doc)."""
        # 1. What this replica keeps of the batch's gradients.
        grads_and_vars = self.zero.batch_gradients(grads_and_vars)
        k = self.layout.accumulate
        if k == 1:
            self._apply(grads_and_vars)
            return
        # 2. Accumulation: every k-th batch goes on, with the mean of the k batches' gradients.
        kept = {id(v) for _, v in grads_and_vars}
        pairs = [(a, v) for a, v in zip(self.accumulators, self.model.trainable_weights)
                 if a is not None and id(v) in kept]
        grads = {id(v): g for g, v in grads_and_vars}
        for a, v in pairs:
            a.assign_add(tf.convert_to_tensor(grads[id(v)]))
        self.batches.assign_add(1)

        def mean_and_reset():
            mean = [(tf.convert_to_tensor(a) / k, v) for a, v in pairs]
            with tf.control_dependencies([g for g, _ in mean]):
                self._apply(mean)
                for a, _ in pairs:
                    a.assign(tf.zeros_like(a))
            return tf.constant(0)
        tf.cond(self.batches % k == 0, mean_and_reset, lambda: tf.constant(0))

    def _apply(self, grads_and_vars):
        optimizer = self.optimizer
        # 3. The reduction over the replicas (ZeRO-1: a reduce-scatter, to this replica's own).
        grads_and_vars = self.zero.update_gradients(grads_and_vars)
        # 4. Keras 3 corrections, on the reduced gradients: duplicate embedding rows summed (Adam
        #    squares each), then clipping by their global norm (tensorflow/tensorflow#33929).
        grads = [gradients.sum_duplicate_rows(g) for g, _ in grads_and_vars]
        scale = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            scale = optimizer.scale_loss(tf.constant(1.0))
        grads = gradients.clip(grads, self.clipnorm, self.zero.norm_sum, scale)
        # 5. The update (its own all-reduce off: `compat.reduce_nothing_in_apply`).
        optimizer.apply(grads, [v for _, v in grads_and_vars])
        # 6. What follows it (ZeRO-1, 2: each replica's updated variables to every replica).
        self.zero.after_update()
