"""The training step of tfdist's GPT, top to bottom.

Keras's `fit` drives training (callbacks, the progress, the backup); for tfdist's GPT each of its
steps is this one, which `install()` makes the model's `train_step` (the documented place to
change what `fit` does). A batch:

1. forward, loss and gradients: a model laid out over devices (`tfdist.models.pipeline`) runs
   its pipeline schedule (GPipe or 1F1B), each backward op on its stage's device; a whole GPT, one
   gradient tape; in both, by what the ZeRO stage says (`sources`: under ZeRO-3 the weights this
   replica holds, whose gradients the backward pass reduce-scatters);
2. Keras's `loss` metric, which the logs and the progress show;
3. what this replica keeps of its gradients (the ZeRO stage's `batch_gradients`: all of them, or
   under ZeRO-2 its own share, reduce-scattered at once).

With gradient accumulation (`train.grad_accum_steps` = k) the first k - 1 batches of an update's
window stop there, adding what they keep to this replica's sums (`accumulate`); the k-th goes on
with the mean. Keras runs one function for each kind, chosen batch by batch on the host, so no
collective and no optimizer update sits in a cond (`install`). The batch that ends an update
(every batch without accumulation) goes on (`update`):

4. the reduction over the replicas (the stage's `update_gradients`: the strategy's all-reduce, in
   buckets that start while the backward pass runs, or ZeRO-1's reduce-scatter);
5. the Keras 3 corrections, after the reduction (`tfdist.parallel.gradients`): duplicated
   embedding rows summed, then clipping by the global norm of the reduced gradient (each replica
   holding a share under ZeRO: the stage's `norm_sum`);
6. the optimizer's update, with its own all-reduce switched off: the gradients are reduced;
7. what follows it (the stage's `after_update`: ZeRO-1 and 2 all-gather the updated weights).

Each parallel axis plugs in here through its own module: the pipeline's schedule, the
strategy's collective, the ZeRO stage (`tfdist.parallel.zero`, whose interface is all the step
asks of it). A user's own Keras model keeps Keras's `train_step` and gets the reduction and
corrections inside its optimizer instead (`Strategy.wrap_optimizer`); under ZeRO-3, or with
accumulation where Keras's own cannot run, it takes this step too
(`tfdist.strategies.keras_program`).

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
    ...     step = TrainStep(model, strategy, Layout(accumulate=2), clipnorm=1.0).install()
    >>> tokens = tf.random.stateless_uniform((8, 17), (0, 0), maxval=256, dtype=tf.int32)
    >>> data = tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()
    >>> history = model.fit(data, epochs=1, steps_per_epoch=4, verbose=0)
    >>> int(model.optimizer.iterations.numpy())  # 4 batches, 2 per update
    2
"""
from tfdist import compat
from tfdist.errors import UsageError
from tfdist.parallel import gradients, zero
from tfdist.runtime import nonfinite
from tfdist.runtime.lazy import keras, tf


class TrainStep:
    """The step of `model` (compiled, built; a GPT or its `Pipeline`, or a user's model that
    tfdist steps) under `strategy` (a tfdist plugin), for `layout` (a
    `tfdist.parallel.layout.Layout`: its accumulation, ZeRO stage, split). `clipnorm`: the bound
    of the gradients' global norm (0: none). `reduce(grads_and_vars)`: the reduction without ZeRO
    (default: the strategy's). `collectives`: ZeRO's (default: the strategy's). `zero_options`:
    the ZeRO stage's (`tfdist.parallel.zero.make`; a fault test's `skip`); `offload`: its
    `tfdist.parallel.zero.offload.Offload` (ZeRO-Offload), or None. Create it inside
    `strategy.scope()`: it builds the optimizer (and its accumulators). `install()` makes it the
    model's. `skip_nonfinite` = K > 0: an update whose loss or gradients are not finite on any
    replica is skipped on every replica, and K in a row end the run (`NonFiniteSteps`); 0: off
    (a mixed_float16 run's loss-scale optimizer skips such steps on its own)."""

    def __init__(self, model, strategy, layout, clipnorm=0.0, reduce=None, collectives=None,
                 zero_options=None, skip_nonfinite=0, offload=None):
        self.model, self.layout, self.strategy = model, layout, strategy
        self.clipnorm = clipnorm
        self.optimizer = optimizer = strategy.prepared(model.optimizer)
        # The gradients are reduced here: Keras's optimizer must not all-reduce them again.
        compat.reduce_nothing_in_apply(optimizer)
        if layout.split:  # each variable's update on its device (Keras 3 leaves it unplaced)
            compat.update_on_variable_device(optimizer)
        if layout.zero and collectives is None:
            collectives = strategy.zero_collectives()
        self.zero = zero.make(layout.zero, model, collectives,
                              reduce or strategy.reduce_gradients, offload=offload,
                              **(zero_options or {}))
        self.zero.build(optimizer)  # (under ZeRO: this replica's slots only)
        self.window = layout.accumulate  # batches per update
        self.position = 0  # batches of the current window taken so far (on the host)
        # This replica's sums of the window's gradients (None where another replica keeps one:
        # ZeRO-2, 3), in the order of the trainable weights.
        self.accumulators = []
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            skip_nonfinite = 0  # (its own path: it skips a step whose gradients overflow)
        self.skip = nonfinite.Skipping(skip_nonfinite) if skip_nonfinite else None
        if self.window > 1 or self.skip:  # (skipping: each update's gradients kept, then checked)
            with strategy.local_variables():
                self.accumulators = [_accumulator(v) if self.zero.accumulates(v) else None
                                     for v in model.trainable_weights]

    def install(self):
        """Makes this step the model's: Keras's `fit` calls it for each batch (its
        `train_step`). With accumulation Keras's train function is two, chosen for each batch on
        the host (`tfdist.compat.train_function_per_batch`): `accumulate` for a batch inside an
        update's window, this step for the batch that ends it. So no collective and no
        optimizer update sits in a cond, where MirroredStrategy's merge_call cannot run
        (keras-team/keras#20582). Returns the step."""
        self.model.train_step = self
        if (self.window > 1 or self.skip) and \
                (getattr(self.model, "steps_per_execution", 1) or 1) > 1:
            raise UsageError(f"steps_per_execution={self.model.steps_per_execution} runs "
                             f"several batches in one call, and gradient accumulation and the "
                             f"skipping of non-finite updates choose each batch's step on the "
                             f"host; compile with steps_per_execution=1")
        if self.skip:
            self._install_checked()
        elif self.window > 1:
            compat.train_function_per_batch(self.model, self._next_batch,
                                            {"accumulate": self.accumulate, "update": self})
        return self

    def _install_checked(self):
        """Skipping non-finite updates: every batch is `accumulate_checked` (its gradients added
        to the sums, and whether they are finite); after the window's last batch the host reads
        whether any replica's were not (agreed by a reduction over the replicas, then over the
        processes) and runs the update (`apply_sums`) or drops the sums (`drop_sums`), each a
        function of no batch. The update stays out of a cond (keras-team/keras#20582)."""
        run = self.strategy.tf_strategy.run
        apply_sums = tf.function(lambda: run(self.apply_sums))
        drop_sums = tf.function(lambda: run(self.drop_sums))

        def after(logs):  # on the host, after each batch
            self.skip.pending |= float(logs.pop(nonfinite.FLAG)) > 0
            if self.position == 0:  # the window's last batch: update, or skip it everywhere
                skipped = self.strategy.any_process(self.skip.pending)
                (drop_sums if skipped else apply_sums)()
                self.skip.record(skipped, int(self.model.optimizer.iterations.numpy()))
            logs[nonfinite.COUNT] = self.skip.skipped
            return logs
        compat.train_function_per_batch(self.model, self._next_batch,
                                        {"accumulate": self.accumulate_checked,
                                         "update": self.accumulate_checked}, after=after)

    def _next_batch(self):
        """The step of the next batch: "update" for a window's last, else "accumulate". (A run
        starts at a window's start: backups fall on update boundaries.)"""
        self.position = (self.position + 1) % self.window
        return "accumulate" if self.position else "update"

    # -- a batch -------------------------------------------------------------------------------
    def __call__(self, data):
        """The batch that ends an update (every batch, without accumulation): its gradients, with
        the window's, reduced, corrected and applied. Returns the metrics Keras logs."""
        grads_and_vars, metrics = self._gradients(data)
        self.update(grads_and_vars)
        return metrics

    def accumulate(self, data):
        """A batch inside an update's window: its gradients added to this replica's sums."""
        grads_and_vars, metrics = self._gradients(data)
        self.accumulate_gradients(grads_and_vars)
        return metrics

    def accumulate_checked(self, data):
        """A batch when non-finite updates are skipped: its gradients added to this replica's
        sums, and in the metrics (`nonfinite.FLAG`) the replicas of this step whose loss or
        kept gradients were not finite (a sum over them)."""
        grads_and_vars, metrics, loss = self._gradients(data, with_loss=True)
        kept = self.accumulate_gradients(grads_and_vars)
        bad = nonfinite.flag(loss, [g for g, _ in kept])
        context = tf.distribute.get_replica_context()
        if context is not None:  # (several replicas of a tf.distribute strategy)
            bad = context.all_reduce(tf.distribute.ReduceOp.SUM, bad)
        return {**metrics, nonfinite.FLAG: bad}

    def apply_sums(self):
        """The update of the window whose gradients the sums hold (their mean); the sums start
        again from 0."""
        grads_and_vars = [(tf.convert_to_tensor(a) / self.window, v)
                          for a, v in zip(self.accumulators, self.model.trainable_weights)
                          if a is not None]
        with tf.control_dependencies([g for g, _ in grads_and_vars]):
            self.drop_sums()
        self._apply(grads_and_vars)

    def drop_sums(self):
        """The sums back to 0: the window's update is skipped."""
        for a in self.accumulators:
            if a is not None:
                a.assign(tf.zeros_like(a))

    def update_over(self, batches):
        """One update over the window's `batches`, all in this call, their gradients summed as
        tensors (no sums kept between calls): the parameter server's, whose workers each take a
        whole window and apply it as one asynchronous update. Returns the last batch's
        metrics."""
        total, metrics = None, None
        for data in batches:
            grads_and_vars, metrics = self._gradients(data)
            grads_and_vars = self.zero.batch_gradients(grads_and_vars)
            total = grads_and_vars if total is None else [
                (tf.convert_to_tensor(a) + tf.convert_to_tensor(g), v)
                for (a, v), (g, _) in zip(total, grads_and_vars)]
        self._apply([(g / len(batches), v) for g, v in total])
        return metrics

    def _gradients(self, data, with_loss=False):
        """([(gradient, variable)] of one batch, the metrics to return (and, `with_loss`, the
        batch's loss)); Keras's `loss` metric kept as its own train_step keeps it."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        model, optimizer = self.model, self.optimizer
        y_pred = None
        # Forward, loss, gradients (of the loss scaled for mixed_float16, if it is).
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
        rows = tf.shape(tf.nest.flatten(x)[0])[0]
        if self.skip:  # (a skipped batch's loss stays out of the epoch's mean)
            finite = tf.math.is_finite(loss)
            loss_kept, rows = tf.where(finite, loss, tf.zeros_like(loss)), tf.where(finite, rows, 0)
            compat.track_loss(model, loss_kept, rows)
        else:
            compat.track_loss(model, loss, rows)
        if y_pred is None:
            metrics = model.get_metrics_result()
        else:
            metrics = model.compute_metrics(x, y, y_pred, sample_weight)  # a user's compiled
        if with_loss:
            return list(zip(grads, variables)), metrics, loss
        return list(zip(grads, variables)), metrics

    # -- its gradients -------------------------------------------------------------------------
    def accumulate_gradients(self, grads_and_vars):
        """Adds what this replica keeps of a batch's gradients (the module doc's step 1) to its
        sums of the window; returns those kept pairs."""
        kept = self.zero.batch_gradients(grads_and_vars)
        for a, g, _ in self._sums(kept):
            a.assign_add(tf.convert_to_tensor(g))
        return kept

    def update(self, grads_and_vars):
        """Keeps, averages over the window, reduces, corrects and applies the gradients of the
        batch that ends an update (the module doc)."""
        # 1. What this replica keeps of the batch's gradients.
        grads_and_vars = self.zero.batch_gradients(grads_and_vars)
        # 2. Accumulation: the mean of the window's gradients; its sums start again from 0.
        if self.window > 1:
            sums = self._sums(grads_and_vars)
            grads_and_vars = [((tf.convert_to_tensor(a) + tf.convert_to_tensor(g)) / self.window,
                               v) for a, g, v in sums]
            with tf.control_dependencies([g for g, _ in grads_and_vars]):
                for a, _, _ in sums:
                    a.assign(tf.zeros_like(a))
        self._apply(grads_and_vars)

    def _sums(self, grads_and_vars):
        """[(accumulator, gradient, variable)] of the pairs with a gradient whose variable this
        replica accumulates."""
        sums = {id(v): a for a, v in zip(self.accumulators, self.model.trainable_weights)
                if a is not None}
        return [(sums[id(v)], g, v) for g, v in grads_and_vars if g is not None and id(v) in sums]

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
        self.zero.apply(optimizer, grads, [v for _, v in grads_and_vars])
        # 6. What follows it (ZeRO-1, 2: each replica's updated variables to every replica).
        self.zero.after_update()


def _accumulator(variable):
    """A sum of `variable`'s gradients over a window, this replica's own: one per replica of a
    process under MirroredStrategy (ON_READ: each replica adds and reads its own), a variable of
    this process elsewhere (`Strategy.local_variables`). Not in backups: they fall on update
    boundaries, where every sum is 0."""
    name = variable.path.replace("/", "_") + "_gradient_sum"
    return tf.Variable(tf.zeros(variable.shape, tf.float32), trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.SUM)
