"""`tfdist.strategies.get("auto")` for a user's Keras model (tfdist/parallel/budget.py): measured at
its first fit, it trains plainly data parallel where that fits the budget, with ZeRO-3 where only
that does, and its losses equal the same strategy named by hand (within 1e-5). A plain CNN and
keras-hub's GPT-2 (tests/support/auto_program.py)."""
import json
import os
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, run
from tfdist.errors import UsageError
from tfdist.parallel import budget as user_auto

PROGRAM = os.path.join(ROOT, "tests", "support", "auto_program.py")
MIB = 2 ** 20


# -- the choice ---------------------------------------------------------------------------------


def measured(**kw):
    sizes = dict(trainable=100 * MIB, frozen=0.0, slots=2, activations=20 * MIB, rows=8,
                 unit=10 * MIB)
    return user_auto.Measured(**{**sizes, **kw})


def test_the_least_costly_layout_that_fits_the_budget():
    m = measured()  # 100 MiB of weights, Adam's 2 slots, 20 MiB of activations, 2 replicas
    assert user_auto.choose(m, 2, 500 * MIB, "cpu").name == "data parallel"  # 420 MiB
    # ZeRO-1 halves the slots and holds the gradients' pieces and flat buffer: 500 + 20, more
    # than plain (ZeRO-2 too, without accumulation); ZeRO-3 shards all three, two units
    # gathered: 240
    zero3 = user_auto.choose(m, 2, 300 * MIB, "cpu")
    assert (zero3.name, zero3.zero, zero3.offload, zero3.accumulate) == ("ZeRO-3", 3, "none", 1)
    assert zero3.bytes == 240 * MIB
    assert zero3.others == (("data parallel", 420 * MIB), ("ZeRO-1", 520 * MIB),
                            ("ZeRO-2", 520 * MIB))
    # with more slots and replicas ZeRO-1 saves more than its buffers cost: 4 slots over 8
    # replicas, 400 + 50 + 20 against plain's 600 + 20
    m4 = measured(slots=4)
    assert user_auto.choose(m4, 8, 500 * MIB, "cpu").name == "ZeRO-1"
    # one replica: nothing to shard over but ZeRO-3's offload
    assert [x[0][0] for x in user_auto.options(m, 1, "cpu") if x[1] == 1] == [
        "data parallel", "ZeRO-3", "ZeRO-3, offloaded to disk"]
    # host offload saves nothing on a CPU (its memory is the device's): on a GPU it is next
    assert user_auto.choose(m, 2, 100 * MIB, "gpu").offload == "host"
    with pytest.raises(UsageError, match="does not fit in .* the least, ZeRO-3"):
        user_auto.choose(m, 2, 100 * MIB, "cpu")


def test_smaller_batches_before_sharding_where_the_activations_do_not_fit():
    m = measured(activations=400 * MIB)  # plain: 400 + 400 MiB; in 2 pieces 400 + 200 + 100
    c = user_auto.choose(m, 2, 750 * MIB, "cpu")  # (the sums kept between pieces: 100)
    assert (c.name, c.accumulate, c.bytes) == ("data parallel", 2, 700 * MIB)
    assert c.describe == "data parallel, 2 batches per update"
    # the states too: ZeRO-3 (200 + 20, its sums 50) with the fewest pieces that fit (400 / 4)
    c = user_auto.choose(m, 2, 380 * MIB, "cpu")
    assert (c.name, c.accumulate, c.bytes) == ("ZeRO-3", 4, 370 * MIB)


def test_disk_offload_where_the_states_of_a_large_model_do_not_fit_even_sharded():
    m = measured(trainable=8 * 2 ** 30, unit=200 * MIB)  # 2 G parameters
    c = user_auto.choose(m, 1, 16 * 2 ** 30, "cpu")
    assert (c.zero, c.offload) == (3, "disk")


def test_the_measurement_is_the_models_and_leaves_its_state_alone():
    import keras
    import tensorflow as tf
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16384),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.5),
                              keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    before = [v.numpy().copy() for v in model.variables]
    x, y = tf.random.normal((128, 16)), tf.random.normal((128, 4))
    m = user_auto.measure(model, (x, y), replicas=2)
    assert m.trainable == sum(v.numpy().nbytes for v in model.trainable_variables)
    assert m.frozen == sum(v.numpy().nbytes for v in model.non_trainable_variables) > 0
    assert (m.slots, m.rows) == (2, 64)
    # the step keeps at least the dense layer's output and the normalised one, 2 x 16384 floats
    # a row (8 MiB), and not 4 times that (the allocator counts in chunks of up to 1 MiB)
    assert 8 * 2 ** 20 <= m.activations < 32 * 2 ** 20
    assert m.unit == (16 * 16384 + 16384) * 4  # the largest layer's weights
    for a, b in zip(before, model.variables):  # moving statistics and seeds put back
        np.testing.assert_array_equal(a, b.numpy())


def test_bad_arguments_are_one_line():
    import tfdist.strategies
    with pytest.raises(UsageError, match="auto=True under strategy single: it has nothing"):
        tfdist.strategies.get("single", auto=True)
    with pytest.raises(UsageError, match="auto chooses zero and offload itself"):
        tfdist.strategies.get("auto", zero=3)
    with pytest.raises(UsageError, match="memory_gb=-1"):
        tfdist.strategies.get("auto", memory_gb=-1)


def test_auto_is_horovod_under_horovodrun():
    from tfdist.strategies import launched_strategy
    assert launched_strategy({"HOROVOD_RANK": "0"}) == "horovod"
    assert launched_strategy({}) == "multi_worker_mirrored"


# -- the programs -------------------------------------------------------------------------------


_SINGLE = {}  # model -> (losses, output) of its one-device run, shared by the tests


def single(model):
    if model not in _SINGLE:
        _SINGLE[model] = program(model, "single")
    return _SINGLE[model]


def program(model, strategy, workers=1, *extra):
    """(each process's losses, output) of the program."""
    argv = [sys.executable, PROGRAM, f"--model={model}", f"--strategy={strategy}", *extra]
    if workers > 1:
        argv = [sys.executable, "-m", "tfdist", "launch", f"--workers={workers}",
                "--max_restarts=0", "--", *argv]
    p = run(argv, timeout=300)
    out = p.stdout + p.stderr
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
               if "RESULT " in line]
    assert len(results) == workers, out[-3000:]
    return [r["loss"] for r in results], out


def assert_equal_losses(a, b):
    for x in a + b:
        assert np.allclose(x, a[0], rtol=0, atol=1e-5), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "gpt2"])
def test_with_room_it_runs_plain_data_parallelism(model):
    losses, out = program(model, "auto")
    assert "tfdist: auto: chose data parallel" in out, out[-3000:]
    assert "measured" in out
    assert_equal_losses(losses, single(model)[0])


@pytest.mark.slow
def test_under_a_budget_for_activations_it_accumulates_smaller_batches():
    """keras-hub's GPT-2 in one process under a budget below what its whole batch needs (0.053
    GiB) and above what half of it does with the sums kept between them (0.045): the data
    re-batched into 2 pieces an update, one device's losses (the same rows an update, no
    normalisation across rows to change)."""
    losses, out = program("gpt2", "auto", 1, "--memory_gb=0.049")
    assert "tfdist: auto: chose data parallel, 2 batches per update" in out, out[-3000:]
    assert_equal_losses(losses, single("gpt2")[0])


@pytest.mark.slow
@pytest.mark.parametrize("model, budget", [("cnn", "0.04"), ("gpt2", "0.030")])
def test_under_a_budget_it_shards_and_equals_zero3_named_by_hand(model, budget):
    """The budget (GiB a process) is below what plain data parallelism needs over 2 processes,
    in any number of pieces (its weights, gradients and slots alone: the CNN's 4 dense layers of
    1024, GPT-2's 2 blocks of width 256), and above ZeRO-3's (in 1 or 2 pieces: the same rows an
    update either way)."""
    losses, out = program(model, "auto", 2, f"--memory_gb={budget}")
    assert "tfdist: auto: chose ZeRO-3" in out and "not data parallel: it needs" in out, \
        out[-3000:]
    named, _ = program(model, "multi_worker_mirrored", 2, "--zero=3")
    assert_equal_losses(losses, named)
