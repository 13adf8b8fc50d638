"""ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054): what each data-parallel replica keeps of the
model's state, stage by stage, behind the one interface tfdist's training step calls.

    stage 0  everything whole on every replica; the strategy all-reduces  stage.Stage
    stage 1  the optimizer states sharded 1/N                             optimizer.ShardedOptimizer
    stage 2  also the gradients that outlive a batch                      optimizer.ShardedGradients
    stage 3  also the weights, gathered per layer where they run          weights.ShardedWeights

Each stage extends the one before and answers `tfdist.parallel.zero.stage.Stage`'s questions;
the step (`tfdist.step`) asks only those. The other modules: `partition` (which replica owns
each variable: one greedy rule for every stage, and the flat layout of the collectives),
`collectives` (what a strategy gives ZeRO: `Strategy.zero_collectives`), `shards` (the backup
files of each replica's share), `offload` and `store` (ZeRO-Offload: the state in host memory
or on disk, stepped on the CPU).

Example (stage 1 of a model over one replica):

    >>> import keras
    >>> from tfdist.parallel import zero
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> sharded = zero.make(1, model, zero.local())
    >>> sharded.build(keras.optimizers.Adam())
    >>> zero.of(model) is sharded, sharded.stage
    (True, 1)
"""
import tfdist.parallel.zero.offload  # noqa: F401  (zero.offload: ZeRO-Offload)
from tfdist.errors import UsageError
from tfdist.parallel.zero import shards  # noqa: F401
from tfdist.parallel.zero.collectives import Collectives, local  # noqa: F401
from tfdist.parallel.zero.optimizer import ShardedGradients, ShardedOptimizer
from tfdist.parallel.zero.partition import Partition, partition  # noqa: F401
from tfdist.parallel.zero.stage import Stage
from tfdist.parallel.zero.weights import ShardedWeights

STAGES = {1: ShardedOptimizer, 2: ShardedGradients, 3: ShardedWeights}


def make(stage, model, collectives=None, reduce=None, offload=None, **options):
    """ZeRO `stage` (0-3) of the built `model`: stage 0 reduces with `reduce(grads_and_vars)`
    (the strategy's); stages 1-3 shard over `collectives`' replicas, with `options` (`skip`;
    stage 3: `regather`), their state held by `offload` (an `offload.Offload`) if given. A
    sharded stage is kept at `model.tfdist_zero` (`of`); stage 3 shards the weights now, so call
    it before the optimizer's slots are built."""
    if stage == 0 and offload is not None:
        raise UsageError("zero.offload needs ZeRO: set zero.stage to 1, 2 or 3 (offload moves "
                         "the optimizer state of stages 1-2, and also the weights under 3)")
    if stage == 0:
        return Stage(model, reduce)
    if stage not in STAGES or collectives is None:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, with the replicas' collectives; got "
                         f"stage {stage!r}")
    sharded = STAGES[stage](model, collectives, offload=offload, **options)
    if stage == 3:
        sharded.wrap()
        sharded.release()
    model.tfdist_zero = sharded
    return sharded


def of(model):
    """The model's sharded ZeRO stage (1-3), or None."""
    return getattr(model, "tfdist_zero", None)


def describe(model):
    """One line: the model's ZeRO stage, this replica's share and the partition's imbalance."""
    sharded = of(model)
    return (sharded or Stage(model, reduce=None)).describe()
