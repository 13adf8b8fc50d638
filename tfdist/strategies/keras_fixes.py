"""The corrections Keras 3.15 needs for `model.fit` under MultiWorkerMirroredStrategy, in one place.

Both are upstream defects (keras-team/keras#20585), applied by `apply()` when a multi-worker
strategy is built; they change nothing for strategies that never reach the patched branches.

1. `TensorFlowTrainer._maybe_symbolic_build` reduces the first input batch with
   `strategy.reduce("MEAN", <tuple of PerReplica>)` to learn its shapes. Under
   MultiWorkerMirrored that raises "Attempt to convert a value (PerReplica...)". Shapes are
   all it needs: take the first local replica's batch instead.
2. `reduce_per_replica(..., "mean")` on a multi-worker collective strategy calls
   `strategy.reduce("MEAN", v, axis=0)`, which fails on the scalar loss with "Invalid reduction
   dimension 0 for input with 0 dimensions". The values are each replica's metric results, so
   average them across replicas without an axis (also when a worker has a single replica and
   they arrive as plain tensors, which upstream would report unreduced: worker 0's loss only).
"""
import tensorflow as tf
from keras.src import tree
from keras.src.backend.tensorflow import trainer as tf_trainer

_applied = False


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    if self._distribute_strategy is None:
        return
    if iterator is not None:
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda x: (self.distribute_strategy.experimental_local_results(x)[0]
                           if isinstance(x, tf.distribute.DistributedValues) else x), batch)
            break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def apply():
    global _applied
    if _applied:
        return
    upstream_reduce = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if (reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(strategy)
                and not isinstance(strategy, tf.distribute.TPUStrategy)):
            # With one local replica the values are plain tensors, not PerReplica: they still
            # hold only this worker's numbers and must be averaged across workers.
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return upstream_reduce(values, strategy, reduction)

    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    _applied = True
