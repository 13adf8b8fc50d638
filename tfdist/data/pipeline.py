"""tf.data pipeline of fixed-length windows read from a token store: deterministic, sharded per
replica, resumable, and independent of the corpus size.

Batch contents are a pure function of (seed, step): the start offsets of global step `s` are
`stateless_uniform([global_batch], seed=(seed, s))`. With gradient accumulation over k steps,
they are drawn per update instead, k x global_batch of them, and step `s` takes its k-th part: an
update trains on the very rows one batch k times larger would. So

* the same seed gives the same batches on any number of replicas (single vs mirrored compare
  step for step);
* resuming at step `s` starts the range at `s`: no earlier batch is read or replayed;
* each replica takes its own rows of the global batch, chosen through `tf.distribute.InputContext`
  (global replica id = input pipeline id * replicas per pipeline + local index), so one global
  step's examples across all replicas are exactly the global batch, without duplicates.

The windows are read from the store's shard files by TF ops (`tfdist.data.store.Split.windows`):
no token is held in memory or embedded in the graph, so the same `batch(step)` runs in any input
pipeline and inside the functions a parameter-server coordinator schedules on its workers.

Example:

    >>> import os, tempfile
    >>> import numpy as np
    >>> from tfdist.data import store
    >>> from tfdist.data.pipeline import Windows
    >>> s = store.from_arrays(os.path.join(tempfile.mkdtemp(), "hello-store"),
    ...                       train=np.frombuffer(b"hello world " * 100, np.uint8),
    ...                       val=np.frombuffer(b"hello there " * 10, np.uint8))
    >>> w = Windows(s.split("train"), block_size=8, global_batch=4, seed=0)
    >>> x, y = next(iter(w.dataset_fn(start_step=0, num_steps=10)(None)))
    >>> tuple(x.shape), tuple(y.shape), bool((x[:, 1:] == y[:, :-1]).numpy().all())
    ((4, 8), (4, 8), True)
"""
import tensorflow as tf

from tfdist.errors import UsageError


class Windows:
    """Random windows of `block_size + 1` tokens from one split of a token store.

    `accumulate`: steps per optimizer update (their rows drawn together). `on_input(windows,
    input_context)`, if given, is called as each input pipeline is built. `skips`: [(step, n)]:
    after step `step` (counted from 1) the data order moves on by `n` batches (a loss spike's
    rollback: `tfdist.callbacks.spike`): the step of index i (from 0) reads the batch of
    position i + the n of every skip with step <= i.
    """

    def __init__(self, split, block_size, global_batch, seed, on_input=None, accumulate=1,
                 skips=()):
        if split.num_tokens < block_size + 2:
            raise UsageError(f"the {split.name} split has {split.num_tokens:,} tokens, shorter "
                             f"than one window of {block_size + 1}; use more text or a smaller "
                             f"model.block_size")
        self.split = split
        self.num_tokens = split.num_tokens
        self.block_size = block_size
        self.global_batch = global_batch
        self.seed = seed
        self.on_input = on_input
        self.accumulate = accumulate
        self.skips = list(skips)

    def position(self, step):
        """The data position of global step `step` (int64): the step, moved on by the skips
        before it."""
        step = tf.cast(step, tf.int64)
        position = step
        for after, n in self.skips:
            # (`step` counts from 0: the step after step `after` is index `after`)
            position += tf.where(step >= after, tf.constant(n, tf.int64), tf.constant(0, tf.int64))
        return position

    def offsets(self, step):
        """Start offsets (int64, global_batch) of the windows of global step `step`: its part of
        its update's (`accumulate` x global_batch, drawn from the update's number), at the
        step's data position."""
        k, b = self.accumulate, self.global_batch
        step = self.position(step)
        update_rows = tf.random.stateless_uniform(
            [b * k], seed=tf.stack([tf.cast(self.seed, tf.int64), step // k]),
            minval=0, maxval=self.num_tokens - self.block_size - 1, dtype=tf.int64)
        part = step % k
        return update_rows[part * b:(part + 1) * b]

    def batch(self, step, replica=0, replicas=1):
        """(x, y) of global step `step` (int64 tensor or int), or of one replica's share of it.
        Graph-friendly: the parameter-server loop calls it inside the step it schedules."""
        b = self.global_batch // replicas
        rows = self.offsets(step)[replica * b:(replica + 1) * b]
        # static shapes, as XLA on TPUs needs
        w = tf.ensure_shape(self.split.windows(rows, self.block_size + 1),
                            [b, self.block_size + 1])
        return w[:, :-1], w[:, 1:]

    def dataset_fn(self, start_step, num_steps, repeat=False):
        """Returns `fn(input_context) -> tf.data.Dataset` of per-replica (x, y) batches.

        Steps `start_step .. start_step + num_steps - 1`. With `input_context=None` the dataset
        yields whole global batches (one replica). With `repeat=True` the same steps cycle forever
        (fixed validation batches).
        """
        def fn(input_context=None):
            if self.on_input and not repeat:
                self.on_input(self, input_context)
            if input_context is None:
                replicas = 1
                pipelines = 1
                pipeline_id = 0
            else:
                replicas = input_context.num_replicas_in_sync
                pipelines = input_context.num_input_pipelines
                pipeline_id = input_context.input_pipeline_id
            if self.global_batch % replicas:
                raise ValueError(f"global batch {self.global_batch} is not divisible by "
                                 f"{replicas} replicas")
            local = replicas // pipelines  # replicas fed by this input pipeline

            def element(k):
                """The k-th element of this pipeline: (step, local replica)."""
                step = start_step + k // local
                return self.batch(step, pipeline_id * local + k % local, replicas)

            ds = tf.data.Dataset.range(num_steps * local)
            if repeat:
                ds = ds.repeat()
            opts = tf.data.Options()
            opts.deterministic = True
            # Sharding is done above, per replica; TF must not shard again.
            opts.experimental_distribute.auto_shard_policy = (
                tf.data.experimental.AutoShardPolicy.OFF)
            return (ds.map(element, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                    .prefetch(tf.data.AUTOTUNE).with_options(opts))

        return fn


# -- a user's data (the parameter server's per-worker datasets) --------------------------------

def every_nth(dataset, n, index):
    """A per-worker dataset_fn of `dataset`: worker `index()` of `n` reads batches index,
    index + n, ... The dataset is rebuilt on each worker from its serialized graph (as TF sends a
    dataset), so that the workers do not train on the same batches."""
    # external_state_policy 0: warn about state it cannot send
    graph = tf.raw_ops.DatasetToGraphV2(input_dataset=tf.data.experimental.to_variant(dataset),
                                        external_state_policy=0, strip_device_assignment=True)
    spec = dataset.element_spec

    def dataset_fn():
        copy = tf.data.experimental.from_variant(tf.raw_ops.DatasetFromGraph(graph_def=graph),
                                                 spec)
        return copy.shard(n, index())
    return dataset_fn


def from_arrays(x, y, sample_weight, batch_size, what):
    """`x` if it is a dataset, else a dataset of the (x, y, sample_weight) batches Keras would
    make of arrays (`what`: the call, named in the error for anything else)."""
    if isinstance(x, tf.data.Dataset):
        return x
    if x is None or callable(x):
        raise UsageError(f"{what} takes a tf.data.Dataset or arrays here")
    rows = tuple(v for v in (x, y, sample_weight) if v is not None)
    return tf.data.Dataset.from_tensor_slices(rows if len(rows) > 1 else rows[0]).batch(
        batch_size or 32)
