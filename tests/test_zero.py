"""ZeRO (tfdist/parallel/zero/): whole variables partitioned with a small imbalance, each replica
holding 1/N of the optimizer state, one replica's ZeRO step equal to the plain optimizer's (with and
without gradient accumulation), and 2 replicas under Horovod and under multi_worker_mirrored giving
plain data parallelism's losses with bitwise identical weights after every step; without the
all-gather the replicas drift apart; killed runs resume from the shards, also at another number of
replicas; bad configs are one line."""
import json
import os
import shutil

import keras
import numpy as np
import pytest

from tests.helpers import (
    assert_usage_error,
    driver,
    driver_group,
    first_fast,
    hashes,
    load_config,
    losses,
    max_diff,
    metrics,
    tfdist,
    weights,
)
from tfdist.parallel import zero

STEPS = 20


def gpt_nano():
    from tfdist.models.gpt import GPT
    c = load_config("configs/gpt_nano.py")
    c.model.vocab_size = 256  # the byte tokenizer's
    model = GPT.from_model_config(c.model)
    model.build()
    return c, model


def fake(rank, size):
    """Collectives of replica `rank` of `size` that only build (nothing is sent)."""
    return zero.Collectives(rank, size, None, None, None, None)


def slot_bytes(optimizer):
    return sum(int(np.prod(v.shape)) * 4 for v in optimizer.variables if len(v.shape))


def test_each_replica_holds_one_nth_of_the_optimizer_state():
    from tfdist.optimizers import make_optimizer
    c, model = gpt_nano()
    plain = make_optimizer(c.train, 100)
    plain.build(model.trainable_variables)
    total = slot_bytes(plain)
    for n in (2, 4):
        shares = []
        for r in range(n):
            opt = make_optimizer(c.train, 100)
            sharded = zero.make(1, model, fake(r, n))
            sharded.build(opt)
            shares.append(slot_bytes(opt))
        imbalance = sharded.partition.imbalance
        assert sum(shares) == total  # every slot exists on exactly one replica
        assert max(shares) <= total / n * imbalance + 1e-6
        assert 1.0 <= imbalance < 1.10, imbalance  # gpt_nano: 1.02 over 2, 1.09 over 4
        assert f"imbalance {imbalance:.2f}" in zero.describe(model)


def test_the_partition_is_balanced_and_the_same_on_every_replica():
    sizes = [100, 7, 50, 50, 3, 90]
    owners = zero.partition(sizes, 2)
    assert owners == zero.partition(list(sizes), 2)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert sorted(loads) == [150, 150]


def test_a_tensor_parallel_layers_shards_share_one_owner():
    """(so that a backup can save their slots joined, as the unsplit variable's)"""
    v = [keras.Variable(np.zeros(shape, "float32"))
         for shape in [(8, 4), (8, 4), (16,), (4,), (4,)]]
    v[0].tfdist_shard_of = v[1].tfdist_shard_of = "kernel"
    v[3].tfdist_shard_of = v[4].tfdist_shard_of = "bias"
    s = zero.Partition(v, 2)
    assert s.owners == [0, 0, 1, 1, 1] and s.loads == [64, 24]


@pytest.mark.parametrize("stage,accumulate", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_one_replica_zero_step_equals_the_plain_optimizer(stage, accumulate):
    """tfdist's step (tfdist.step) with one replica, with and without ZeRO (reduce-scatter, clip
    by the summed norm, update, gather): the weights of Keras's own AdamW with global clipping
    and a decaying learning rate, given the mean of every `accumulate` gradients, over 9 calls
    in a tf.function (ZeRO-2 accumulates its own shard only)."""
    import tensorflow as tf

    import tfdist.strategies
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep
    rng = np.random.default_rng(0)
    init = [rng.normal(size=s).astype("float32") for s in [(6, 4), (4,), (4, 3)]]
    grads = [[rng.normal(size=x.shape).astype("float32") * 5 for x in init] for _ in range(9)]

    def adamw(**kw):
        return keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5),
                                      weight_decay=0.1, **kw)

    reference = [keras.Variable(x) for x in init]
    opt = adamw(global_clipnorm=1.0)
    apply = tf.function(lambda g: opt.apply(g, reference))
    for k in range(0, 9, accumulate):
        apply([tf.constant(np.mean([grads[i][j] for i in range(k, k + accumulate)], 0))
               for j in range(len(init))])
    strategy = tfdist.strategies.get("single")

    def updater(step, model):
        """Each batch's gradients to the step: added to the window's sums, or (every
        `accumulate`-th) ending an update, as `TrainStep.install` chooses for Keras's fit."""
        functions = [tf.function(lambda g, f=f: f(list(zip(g, model.trainable_weights))))
                     for f in (step.accumulate_gradients, step.update)]
        batches = iter(range(1, len(grads) + 1))
        return lambda g: functions[next(batches) % accumulate == 0](g)

    finals = []
    for sharded in (0, stage):
        with strategy.scope():
            model = keras.Sequential([_Weights(init)])
            model.build((None, 1))
            model.compile(optimizer=adamw(), loss="mse")
            step = TrainStep(model, strategy, Layout(zero=sharded, accumulate=accumulate),
                             clipnorm=1.0, collectives=zero.local())
        update = updater(step, model)
        for g in grads:
            update([tf.constant(x) for x in g])
        assert int(model.optimizer.iterations.numpy()) == 9 // accumulate
        finals.append([v.numpy() for v in model.trainable_weights])
    for got in finals:
        assert max(np.abs(a - b.numpy()).max() for a, b in zip(got, reference)) <= 1e-6


class _Weights(keras.layers.Layer):
    """A layer that is only weights (for an optimizer's test)."""

    def __init__(self, init):
        super().__init__()
        self.init = init

    def build(self, input_shape):
        for i, x in enumerate(self.init):
            self.add_weight(shape=x.shape, name=f"w{i}",
                            initializer=keras.initializers.Constant(x))

    def call(self, x):
        return x


@pytest.mark.parametrize("flags,needle", first_fast([
    (["--strategy=single", "--config.zero.stage=1"], "strategy single cannot shard the optimizer"),
    (["--strategy=horovod", "--config.zero.stage=4"], "'zero.stage' must be 0, 1, 2 or 3"),
    (["--strategy=mirrored", "--config.zero.stage=3"], "strategy mirrored cannot shard"),
    (["--strategy=mirrored", "--config.zero.stage=2"], "strategy mirrored cannot shard"),
    (["--strategy=parameter_server", "--config.zero.stage=1"], "parameter_server cannot shard"),
]))
def test_bad_zero_configs_are_one_line(tmp_path, flags, needle):
    assert_usage_error(tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
                              "--config.backup.enabled=False", *flags, check=False), needle)


# -- 2 replicas: Horovod ranks, and multi_worker_mirrored workers ------------------------------

def options(data_dir, stage, strategy="horovod", steps=STEPS, **extra):
    return {"data.data_dir": data_dir, "train.steps": steps, "train.steps_per_epoch": 10,
            "train.batch_size": 16, "train.deterministic": True, "backup.every_steps": 1,
            "strategy.name": strategy, "zero.stage": stage, **extra}


def group(workdir, data_dir, stage, *extra, strategy="horovod", ranks=2, check=True, **more):
    """Runs the driver as `ranks` Horovod ranks, or multi_worker_mirrored workers (`tfdist
    launch`, restarting the group once after a failure, as `make chaos` does)."""
    return driver_group(workdir, options(data_dir, stage, strategy, **more), "--hash-weights",
                        *extra, ranks=ranks, check=check)


def horovod(workdir, data_dir, stage, *extra, **more):
    return group(workdir, data_dir, stage, *extra, strategy="horovod", **more)


def after(workdir, step):
    """The logged losses of the steps after `step`."""
    return [r["loss"] for r in metrics(workdir)["steps"] if r["step"] > step]


def assert_equal_to_plain(run, plain, stage):
    """Per-step losses within 1e-5 of plain data parallelism's, both replicas' weights bitwise
    identical after every step, and each replica's optimizer bytes 1/2 of plain's (with
    accumulation, tests/test_accumulation.py: ZeRO-2's sums too)."""
    a, b = losses(plain), losses(run)
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    h0, h1 = hashes(run, 0), hashes(run, 1)
    assert len(h0) == STEPS and h0 == h1  # bitwise identical after every step
    assert max_diff(weights(run, 0), weights(plain, 0)) <= 1e-5
    full = json.load(open(os.path.join(plain, "optimizer-w0.json")))
    for rank in (0, 1):
        mine = json.load(open(os.path.join(run, f"optimizer-w{rank}.json")))
        assert mine["zero"].startswith(f"ZeRO-{stage} over 2 replica(s)")
        imbalance = float(mine["zero"].rsplit(" ", 1)[1])
        # + 64: the scalars; (the imbalance is printed rounded to 0.01)
        assert mine["bytes"] <= full["bytes"] / 2 * (imbalance + 0.005) + 64, (mine, full)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("zero-plain")
    horovod(d, data_dir, 0, "--dump-weights")
    return d


@pytest.fixture(scope="module")
def zero1(tmp_path_factory, data_dir):
    """ZeRO-1 over 2 ranks, uninterrupted, backed up every step."""
    d = tmp_path_factory.mktemp("zero-1")
    horovod(d, data_dir, 1, "--dump-weights")
    return d


KILL_AT = 5


@pytest.fixture(scope="module")
def killed(tmp_path_factory, data_dir):
    """ZeRO-1 over 2 ranks, rank 1 SIGKILLed after step 5 (its backup written)."""
    d = tmp_path_factory.mktemp("zero-killed")
    p = horovod(d, data_dir, 1, "--kill-at-step", str(KILL_AT), "--kill-worker", "1", check=False)
    assert p.returncode != 0
    assert sorted(os.listdir(d / "backup" / "zero" / f"step-{KILL_AT}")) == [
        "rank-0.data-00000-of-00001", "rank-0.index", "rank-0.json",
        "rank-1.data-00000-of-00001", "rank-1.index", "rank-1.json"]
    return d


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.parametrize("stage", [  # without accumulation, stage 2 runs stage 1's step
    1, pytest.param(2, marks=pytest.mark.long)])
def test_zero_under_horovod_equals_plain_data_parallel(tmp_path, data_dir, plain, zero1, stage):
    if stage == 1:
        tmp_path = zero1
    else:
        horovod(tmp_path, data_dir, stage, "--dump-weights")
    assert_equal_to_plain(tmp_path, plain, stage)


@pytest.mark.slow
@pytest.mark.horovod
def test_zero_composes_with_pipeline_stages(tmp_path, data_dir, plain):
    """ZeRO-1 over 2 ranks, each a pipeline of 2 stages (2 microbatches): plain's losses."""
    horovod(tmp_path, data_dir, 1, "--dump-weights",
            **{"pipeline.stages": 2, "pipeline.microbatches": 2})
    assert_equal_to_plain(tmp_path, plain, 1)


@pytest.mark.slow
@pytest.mark.horovod
def test_zero_composes_with_tensor_parallelism(tmp_path, data_dir, zero1):
    """ZeRO-1 over 2 ranks, each holding t = 2 tensor-parallel shards (a layer's shards of one
    kernel share an owner), rank 1 SIGKILLed after step 5, the ranks identical until then. Its
    backup (the slots saved as the unsplit variables') resumes at t = 1 with the uninterrupted
    ZeRO-1 run's losses within 1e-5."""
    run = tmp_path / "run"
    p = horovod(run, data_dir, 1, "--dump-weights", "--kill-at-step", str(KILL_AT),
                "--kill-worker", "1", check=False, **{"tensor.parallel": 2})
    assert p.returncode != 0
    assert len(hashes(run, 0)) >= KILL_AT and hashes(run, 0)[:KILL_AT] == hashes(run, 1)[:KILL_AT]
    p = horovod(run, data_dir, 1)
    assert f"at step {KILL_AT} of {STEPS}" in p.stdout, p.stdout[-3000:]
    resumed, reference = after(run, KILL_AT), after(zero1, KILL_AT)
    assert len(resumed) == STEPS - KILL_AT
    assert max(abs(x - y) for x, y in zip(resumed, reference)) <= 1e-5, (resumed, reference)


@pytest.mark.slow
@pytest.mark.horovod
def test_without_the_all_gather_the_ranks_drift_apart(tmp_path, data_dir):
    horovod(tmp_path, data_dir, 1, "--skip-zero-gather", steps=10)
    assert hashes(tmp_path, 0)[-1] != hashes(tmp_path, 1)[-1]


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.parametrize("stage,ranks", [  # (long: the suite's time; (3, 1) resumes another size)
    pytest.param(1, 2, marks=pytest.mark.long), (1, 1), (3, 1),
    pytest.param(3, 2, marks=pytest.mark.long)])
def test_a_killed_run_resumes_from_its_shards_at_two_ranks_and_at_one(tmp_path, data_dir, request,
                                                                    stage, ranks):
    """Same N: bitwise the uninterrupted run's weights. N = 2 -> 1 (resharded): its losses.
    ZeRO-3: each rank's weights are in its shard, read at N = 1 from whichever holds them."""
    killed_run, reference_run = (request.getfixturevalue(f) for f in (
        ("killed", "zero1") if stage == 1 else ("killed3", "zero3_run")))
    shutil.copytree(killed_run, tmp_path / "run")
    p = horovod(tmp_path / "run", data_dir, stage, "--dump-weights", ranks=ranks)
    assert f"at step {KILL_AT} of {STEPS}" in p.stdout, p.stdout[-3000:]
    resumed, reference = after(tmp_path / "run", KILL_AT), after(reference_run, KILL_AT)
    assert len(resumed) == len(reference) == STEPS - KILL_AT
    assert max(abs(a - b) for a, b in zip(resumed, reference)) <= 1e-5, (resumed, reference)
    if ranks == 2:
        assert max_diff(weights(tmp_path / "run", 0), weights(reference_run, 0)) == 0.0
        assert hashes(tmp_path / "run", 0)[-1] == hashes(tmp_path / "run", 1)[-1]


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.long  # time: the resume of 2 ranks' shards at 1 rank shows the resharding
@pytest.mark.parametrize("stage", [1, 3])
def test_a_one_rank_backup_resumes_at_two_ranks(tmp_path, data_dir, request, stage):
    reference = request.getfixturevalue("zero1" if stage == 1 else "zero3_run")
    horovod(tmp_path, data_dir, stage, "--kill-at-step", str(KILL_AT), "--kill-worker", "0",
            ranks=1, check=False)
    p = horovod(tmp_path, data_dir, stage, ranks=2)
    assert f"at step {KILL_AT} of {STEPS}" in p.stdout, p.stdout[-3000:]
    resumed, reference = after(tmp_path, KILL_AT), after(reference, KILL_AT)
    assert len(resumed) == STEPS - KILL_AT
    assert max(abs(a - b) for a, b in zip(resumed, reference)) <= 1e-5, (resumed, reference)


@pytest.mark.slow
@pytest.mark.horovod
def test_a_backup_whose_shard_is_missing_is_one_line(tmp_path, data_dir, killed):
    shutil.copytree(killed, tmp_path / "run")
    for step in os.listdir(tmp_path / "run" / "backup" / "zero"):  # every backup's (one alone:
        os.remove(tmp_path / "run" / "backup" / "zero" / step / "rank-1.json")  # the one before)
    o = options(data_dir, 0, **{"strategy.name": "single"})  # the plain model reads shards too
    p, _ = driver(tmp_path / "run", o, check=False)
    assert_usage_error(p, f"ckpt-{KILL_AT} (lacks the ZeRO optimizer shard(s) of replica(s) [1])")


# -- multi_worker_mirrored: TF's collectives (all-to-all + sum, gather) in a group of ZeRO's own --

@pytest.fixture(scope="module")
def plain_mwms(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("zero-plain-mwms")
    group(d, data_dir, 0, "--dump-weights", strategy="multi_worker_mirrored")
    return d


@pytest.fixture(scope="module")
def zero1_mwms(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("zero-1-mwms")
    group(d, data_dir, 1, "--dump-weights", strategy="multi_worker_mirrored")
    return d


@pytest.mark.slow
@pytest.mark.long  # time: MWMS's ZeRO collectives train in make test in test_accumulation.py
@pytest.mark.parametrize("stage", [1, 2])  # (ZeRO-2, ZeRO-3: equal to one device within 1e-5)
def test_zero_under_multi_worker_mirrored_equals_plain_data_parallel(tmp_path, data_dir,
                                                                     plain_mwms, zero1_mwms, stage):
    if stage == 1:
        tmp_path = zero1_mwms
    else:
        group(tmp_path, data_dir, stage, "--dump-weights", strategy="multi_worker_mirrored")
    assert_equal_to_plain(tmp_path, plain_mwms, stage)


@pytest.mark.slow
@pytest.mark.long
def test_without_the_all_gather_mwms_workers_drift_apart(tmp_path, data_dir):
    group(tmp_path, data_dir, 1, "--skip-zero-gather", strategy="multi_worker_mirrored", steps=10)
    assert hashes(tmp_path, 0)[-1] != hashes(tmp_path, 1)[-1]


@pytest.mark.slow
@pytest.mark.long  # make chaos-zero repeats it 5 times; test_multi_worker kills MWMS workers too
def test_a_killed_mwms_worker_resumes_from_the_shards_bitwise(tmp_path, data_dir, zero1_mwms):
    """Worker 1 SIGKILLed after step 7; `tfdist launch` restarts both, which resume from the
    shards at step 7 and end bitwise equal to an uninterrupted ZeRO-1 run."""
    reference = zero1_mwms
    p = group(tmp_path / "run", data_dir, 1, "--dump-weights", "--kill-at-step", "7",
              "--kill-worker", "1", strategy="multi_worker_mirrored")
    assert "at step 7 of 20" in p.stdout, p.stdout[-3000:]
    assert max_diff(weights(tmp_path / "run", 0), weights(reference, 0)) == 0.0
    assert hashes(tmp_path / "run", 0)[-1] == hashes(tmp_path / "run", 1)[-1]


# -- ZeRO-3: the weights sharded too (tfdist/parallel/zero/weights.py) ---------------------------

@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("zero-3")
    horovod(d, data_dir, 3, "--dump-weights")
    return d


@pytest.mark.slow
@pytest.mark.horovod
def test_zero3_under_horovod_equals_plain_data_parallel(zero3_run, plain):
    """Losses within 1e-5 of plain data parallelism's over 20 steps, the weights joined from both
    ranks bitwise identical after every step and equal to plain's, each rank's optimizer state
    half of plain's."""
    assert_equal_to_plain(zero3_run, plain, 3)


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.parametrize("skip", ["--skip-zero3-gather",
                                  pytest.param("--skip-zero3-reduce", marks=pytest.mark.long)])
def test_without_the_gather_or_the_reduce_scatter_zero3_differs(tmp_path, data_dir, plain, skip):
    """Companion: each rank computing with only its own weights (zeros for the others'), or
    updating them with only its own gradients, does not give plain's losses (3 steps)."""
    horovod(tmp_path, data_dir, 3, skip, "--kill-at-step", "3", "--kill-worker", "0",
            check=False)
    a, b = losses(plain)[:3], losses(tmp_path)[:3]
    assert len(b) == 3
    assert max(abs(x - y) for x, y in zip(a, b)) > 1e-3, (a, b)


@pytest.fixture(scope="module")
def killed3(tmp_path_factory, data_dir):
    """ZeRO-3 over 2 ranks, rank 1 SIGKILLed after step 5: each rank's weights in its shard."""
    d = tmp_path_factory.mktemp("zero3-killed")
    p = horovod(d, data_dir, 3, "--kill-at-step", str(KILL_AT), "--kill-worker", "1", check=False)
    assert p.returncode != 0
    for r in (0, 1):
        manifest = json.load(open(d / "backup" / "zero" / f"step-{KILL_AT}" / f"rank-{r}.json"))
        assert manifest["weights"], manifest  # the weights this rank held
    return d


@pytest.mark.slow
@pytest.mark.long
def test_zero3_under_multi_worker_mirrored_equals_plain_data_parallel(tmp_path, data_dir,
                                                                      plain_mwms):
    group(tmp_path, data_dir, 3, "--dump-weights", strategy="multi_worker_mirrored")
    assert_equal_to_plain(tmp_path, plain_mwms, 3)


SPLIT = {"pipeline.stages": 2, "pipeline.microbatches": 2, "tensor.parallel": 2}


def assert_split_equal_to_plain(run, plain):
    """Per-step losses within 1e-5 of plain's over 20 steps, both replicas' weights bitwise
    identical after every step (a split model's weights are its stages' and shards' variables,
    so they are not compared with plain's one by one)."""
    a, b = losses(plain), losses(run)
    assert len(a) == len(b) == STEPS
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    h0, h1 = hashes(run, 0), hashes(run, 1)
    assert len(h0) == STEPS and h0 == h1


@pytest.mark.slow
@pytest.mark.horovod
def test_zero3_composes_with_pipeline_tensor_and_sequence_parallelism(tmp_path, data_dir, plain):
    """ZeRO-3 over 2 ranks, each a pipeline of 2 stages x 2 tensor-parallel shards with sequence
    parallelism and the 1F1B schedule: each block gathered on its stage where it runs, its
    shards' gradients reduce-scattered to their owner. Plain data parallelism's losses."""
    horovod(tmp_path, data_dir, 3, **SPLIT, **{"tensor.sequence_parallel": True,
                                               "pipeline.schedule": "1f1b"})
    assert_split_equal_to_plain(tmp_path, plain)


@pytest.mark.slow
@pytest.mark.long
def test_zero3_composes_with_pipeline_and_tensor_parallelism_under_mwms(tmp_path, data_dir,
                                                                         plain_mwms):
    """As above under multi_worker_mirrored (GPipe), whose collective groups are per device: each
    stage gathers on its own."""
    group(tmp_path, data_dir, 3, strategy="multi_worker_mirrored", **SPLIT)
    assert_split_equal_to_plain(tmp_path, plain_mwms)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.horovod
def test_a_split_zero3_backup_resumes_unsplit(tmp_path, data_dir, zero3_run):
    """ZeRO-3 with 2 stages x 2 shards, rank 1 SIGKILLed after step 5: its shards hold each
    tensor-parallel weight whole (its shards have one owner), and the run resumes with neither
    stages nor shards at step 5, with the unsplit ZeRO-3 run's losses."""
    p = horovod(tmp_path, data_dir, 3, "--kill-at-step", str(KILL_AT), "--kill-worker", "1",
                check=False, **SPLIT)
    assert p.returncode != 0
    p = horovod(tmp_path, data_dir, 3)
    assert f"at step {KILL_AT} of {STEPS}" in p.stdout, p.stdout[-3000:]
    resumed, reference = after(tmp_path, KILL_AT), after(zero3_run, KILL_AT)
    assert len(resumed) == STEPS - KILL_AT
    assert max(abs(x - y) for x, y in zip(resumed, reference)) <= 1e-5, (resumed, reference)
