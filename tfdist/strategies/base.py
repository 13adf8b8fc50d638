"""The protocol every strategy plugin implements. Small on purpose.

A plugin wraps one `tf.distribute.Strategy` and answers five things:

* `scope()`: create the model, its variables and the optimizer under it;
* `num_replicas`, `is_chief`, `worker_index`, `num_workers`: batch sizing, logging and who writes
  checkpoints;
* `distribute(dataset_fn)`: per-replica input through `tf.distribute.InputContext`;
* `wrap_optimizer(optimizer)` and `callbacks()`: what the strategy adds to training (here: the
  Keras 3 gradient corrections of `fix_distributed_apply`, no callbacks; Horovod will wrap the
  optimizer in its all-reduce and add an initial broadcast);
* `fit(model, data, ...)`: Keras `model.fit`, in segments so that training can resume at any step.
  A plugin overrides it only when its strategy cannot use Keras `fit` (parameter server).

Example (any registered strategy; see `tfdist.strategies.names()`):

    import keras, tensorflow as tf, tfdist.strategies
    strategy = tfdist.strategies.get("single")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    ds = tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.ones((8, 1)))).repeat()
    strategy.fit(model, ds, epochs=2, steps_per_epoch=5, verbose=0)
"""
import keras
import tensorflow as tf

from tfdist.callbacks import STEPS_KEY
from tfdist.errors import UsageError


def configure_logical_cpus(n):
    """Splits the host CPU into `n` logical devices (before TensorFlow initialises its runtime)."""
    cpus = tf.config.list_physical_devices("CPU")
    current = tf.config.get_logical_device_configuration(cpus[0])
    if current is not None and len(current) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        raise UsageError(f"cannot split the CPU into {n} logical devices: TensorFlow is already "
                         f"initialised in this process; create the strategy before any TF op") from None


def _sum_duplicates(grad):
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    unique, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, grad.dense_shape)


def _smaller_form(grad, var):
    """An `IndexedSlices` gradient with at least as many rows as its variable is sent dense: the
    all-reduce then moves less (a byte-level GPT's embedding: 256 dense rows instead of one slice
    per token of the batch). Same update: Keras 3's optimizers treat slices as dense anyway."""
    if isinstance(grad, tf.IndexedSlices):
        rows = grad.indices.shape[0]
        if rows is not None and rows >= var.shape[0]:
            return tf.convert_to_tensor(grad)
    return grad


def fix_distributed_apply(optimizer):
    """Corrects what a Keras 3 optimizer (TF backend) does with gradients under a strategy.

    Two upstream defects make multi-replica training differ from one device:

    1. Sparse gradients with repeated indices. The all-reduce of an `IndexedSlices` gradient
       (an embedding) concatenates the replicas' slices, and Keras 3's Adam/AdamW then squares the
       slices one by one (`ops.square` on IndexedSlices), so its second moment gets g1^2 + g2^2
       instead of (g1 + g2)^2. tf.keras summed duplicates first (`_deduplicate_indexed_slices`),
       Keras 3 does not. Here duplicates are summed after the all-reduce.
    2. `global_clipnorm` is applied in `BaseOptimizer.apply`, before `_backend_update_step`
       all-reduces the gradients, so every replica clips its own partial gradient by its own
       norm: the pre-aggregation clipping tf.keras refused to do (tensorflow/tensorflow#33929).
       Here clipping runs on the summed gradient instead.
    """
    if getattr(optimizer, "_tfdist_fixed", False):
        return optimizer
    clipnorm = optimizer.global_clipnorm
    optimizer.global_clipnorm = None
    all_reduce = optimizer._all_reduce_sum_gradients

    def all_reduce_then_fix(grads_and_vars):
        reduced = all_reduce([(_smaller_form(g, v), v) for g, v in grads_and_vars])
        grads = [_sum_duplicates(g) for g, _ in reduced]
        if clipnorm:
            grads, _ = tf.clip_by_global_norm(grads, clipnorm)
        return list(zip(grads, [v for _, v in reduced]))

    optimizer._all_reduce_sum_gradients = all_reduce_then_fix
    optimizer._tfdist_fixed = True
    return optimizer


class StepsPerCall(keras.callbacks.Callback):
    """With `steps_per_execution` N, Keras calls `on_train_batch_end` once per N steps, with the
    last step's index: this tells tfdist's callbacks (`tfdist.callbacks.steps_in`) how many."""

    def on_epoch_begin(self, epoch, logs=None):
        self.last = -1

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None:
            logs[STEPS_KEY] = batch - self.last
        self.last = batch


class Strategy:
    """Base plugin: one replica on the default device. Subclasses set `self.tf_strategy`."""

    name = "base"
    #: Keras `jit_compile=True` works under this strategy (it does not under Mirrored on TF 2.21).
    supports_jit_compile = True

    def __init__(self, tf_strategy=None, **unused_options):
        self.tf_strategy = tf_strategy or tf.distribute.get_strategy()

    # -- who am I ------------------------------------------------------------------------------
    @property
    def num_replicas(self):
        return self.tf_strategy.num_replicas_in_sync

    @property
    def is_chief(self):
        return True

    @property
    def worker_index(self):
        return 0

    @property
    def num_workers(self):
        return 1

    @property
    def is_server(self):
        """True on tasks that only serve others (parameter server's worker and ps tasks)."""
        return False

    def serve(self):
        raise NotImplementedError(f"{self.name} has no server tasks")

    def describe(self):
        devices = getattr(self.tf_strategy.extended, "worker_devices", ())
        return f"{self.name}: {self.num_replicas} replica(s) on {', '.join(devices) or 'default device'}"

    #: Saving a checkpoint is a collective operation (every worker must call it), as under the
    #: tf.distribute strategies. False: only the chief saves (Horovod).
    collective_checkpoints = True

    # -- what it adds --------------------------------------------------------------------------
    def scope(self):
        return self.tf_strategy.scope()

    def distribute(self, dataset_fn):
        """Per-replica datasets from `dataset_fn(input_context)`."""
        return self.tf_strategy.distribute_datasets_from_function(dataset_fn)

    def wrap_optimizer(self, optimizer):
        """Adapts a Keras optimizer to the strategy (base: `fix_distributed_apply`)."""
        return fix_distributed_apply(optimizer)

    def callbacks(self):
        return []

    # -- training ------------------------------------------------------------------------------
    def fit(self, model, data, *, epochs=1, steps_per_epoch=None, initial_step=0, callbacks=None,
            validation_data=None, validation_steps=None, verbose="auto"):
        """Trains `model` from global step `initial_step` to `epochs * steps_per_epoch`.

        `data` is either what Keras `fit` accepts (a `tf.data.Dataset`; then `initial_step` must
        fall on an epoch boundary, since tfdist cannot position a foreign dataset), or
        step-addressed data (`tfdist.data.Windows`, or a callable
        `data(start_step) -> dataset_fn(input_context)`): then training resumes at any step
        without replaying a batch. `validation_data` is a dataset, a `dataset_fn(input_context)`
        or a `Windows` (its first `validation_steps` steps, the same every time).

        A resume in the middle of an epoch runs as two Keras `fit` calls: the rest of the
        interrupted epoch, then the remaining whole epochs.
        """
        callbacks = self.callbacks() + list(callbacks or [])  # the strategy's first (Horovod's
        # broadcast must precede the first step; its log averaging, the loggers)
        if getattr(model, "steps_per_execution", 1) > 1:  # Keras reports once per execution
            callbacks.insert(0, StepsPerCall())
        if hasattr(data, "dataset_fn"):  # step-addressed data such as tfdist.data.Windows
            windows, total = data, epochs * (steps_per_epoch or 0)
            data = lambda start: windows.dataset_fn(start, total - start)  # noqa: E731
        if hasattr(validation_data, "dataset_fn"):
            validation_data = validation_data.dataset_fn(0, validation_steps, repeat=True)
        if callable(validation_data) and not isinstance(validation_data, tf.data.Dataset):
            validation_data = self.distribute(validation_data)
        first_epoch, done_in_epoch = divmod(initial_step, steps_per_epoch or 1)
        positionable = callable(data) and not isinstance(data, tf.data.Dataset)
        if not positionable and done_in_epoch:
            raise UsageError(f"cannot resume at step {initial_step} (mid-epoch) with a plain dataset; "
                             f"pass a data(start_step) callable or resume at an epoch boundary")

        def train_data(start):
            return self.distribute(data(start)) if positionable else data

        history = None
        if done_in_epoch and first_epoch < epochs:  # finish the interrupted epoch
            history = model.fit(train_data(initial_step), epochs=first_epoch + 1,
                                initial_epoch=first_epoch,
                                steps_per_epoch=steps_per_epoch - done_in_epoch,
                                callbacks=callbacks, validation_data=validation_data,
                                validation_steps=validation_steps, verbose=verbose, shuffle=False)
            first_epoch += 1
        if first_epoch < epochs and not model.stop_training:
            history = model.fit(train_data(first_epoch * (steps_per_epoch or 0)), epochs=epochs,
                                initial_epoch=first_epoch, steps_per_epoch=steps_per_epoch,
                                callbacks=callbacks, validation_data=validation_data,
                                validation_steps=validation_steps, verbose=verbose, shuffle=False)
        return history
