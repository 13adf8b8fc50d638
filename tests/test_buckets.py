"""Gradient buckets (tfdist/parallel/buckets.py) and reading a profiled step
(tfdist/runtime/profiling.py): the bucket plan, the reduction by buckets in one process, bad
options, and the overlap read from a trace. The 2-process runs that overlap for real are in
tests/test_multi_worker.py and tests/test_horovod.py."""
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import assert_usage_error, tfdist
from tfdist import config
from tfdist.errors import UsageError
from tfdist.parallel import buckets
from tfdist.runtime import profiling


def test_buckets_take_the_last_variables_first_and_close_at_the_size():
    mib = buckets.MIB
    assert buckets.plan([10 * mib, 10 * mib, 30 * mib, 5 * mib], 25 * mib) == [[3, 2], [1, 0]]
    assert buckets.plan([mib] * 4, 100 * mib) == [[3, 2, 1, 0]]  # one bucket: no overlap
    assert buckets.plan([mib] * 3, 1) == [[2], [1], [0]]  # one per gradient
    sizes = list(np.random.default_rng(0).integers(1, 5 * mib, 50))
    plan = buckets.plan(sizes, 4 * mib)
    assert sorted(i for b in plan for i in b) == list(range(50))  # each gradient once
    assert [i for b in plan for i in b] == list(range(49, -1, -1))  # in reverse order
    assert all(sum(sizes[i] for i in b) >= 4 * mib for b in plan[:-1])


def test_reduce_by_buckets_keeps_every_gradient_in_place():
    """Each bucket is one call of the reduction; None gradients stay None, the rest come back
    at their positions."""
    variables = [tf.Variable(tf.zeros((256, 256))) for _ in range(4)]  # 256 KiB each
    grads = [tf.fill((256, 256), float(i)) for i in range(4)]
    grads[1] = None
    calls = []

    def double(group):
        calls.append(len(group))
        return [2 * g for g in group]

    out = buckets.reduce(zip(grads, variables), double, bucket_bytes=300 << 10)
    assert calls == [2, 1]  # [3, 2], then [0] (1 has no gradient)
    assert out[1] == (None, variables[1])
    for i in (0, 2, 3):
        assert out[i][1] is variables[i]
        assert float(out[i][0][0, 0]) == 2.0 * i
    buckets.reduce(zip(grads, variables), double)  # no bucket size (overlap off)
    assert calls[2:] == [3]  # one call of every gradient


@pytest.mark.parametrize("key,value,needle", [
    ("bucket_mb", 0.0, "'strategy.bucket_mb' must be a gradient bucket size in MiB, > 0"),
    ("bucket_mb", -4.0, "'strategy.bucket_mb' must be a gradient bucket size in MiB, > 0"),
    ("overlap", "yes", "'strategy.overlap' must be one of auto, on, off"),
])
def test_bad_bucket_options_name_the_key(key, value, needle):
    c = config.default_config()
    c.strategy.name = "horovod"
    c.strategy[key] = value
    with pytest.raises(UsageError, match=needle.replace(".", r"\.")):
        config.validate(c)


def test_overlap_on_with_zero_is_refused():
    """(the layout judges the combination: tfdist.parallel.layout)"""
    from tfdist import strategies
    from tfdist.parallel.layout import Layout
    c = config.default_config()
    c.strategy.name, c.strategy.overlap, c.zero.stage = "multi_worker_mirrored", "on", 2
    with pytest.raises(UsageError,
                       match="strategy.overlap=on cannot be combined with zero.stage=2"):
        Layout.from_config(c, strategies.get_class(c.strategy.name))
    c.strategy.overlap = "auto"  # ZeRO then reduce-scatters, and auto does not insist
    assert Layout.from_config(c, strategies.get_class(c.strategy.name)).zero == 2


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_under_zero_the_step_reduce_scatters_instead_of_the_buckets(stage):
    """What overlap=auto is beside ZeRO: the step (tfdist.step) reduce-scatters to each replica's
    shard (tfdist.parallel.zero), and the strategy's reduction, the one that overlaps in buckets
    (`Strategy.reduce_gradients`), is not called; without ZeRO it is, once per step."""
    import keras

    from tfdist import strategies
    from tfdist.parallel import zero
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep
    calls = []

    def reduce(grads_and_vars):
        calls.append(len(grads_and_vars))
        return grads_and_vars

    strategy = strategies.get("single")
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(3)])
        model.build((None, 4))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        step = TrainStep(model, strategy, Layout(zero=stage), reduce=reduce,
                         collectives=zero.local())
    before = [v.numpy() for v in model.trainable_weights]
    step.update([(tf.ones_like(v), v) for v in model.trainable_weights])
    assert calls == ([] if stage else [2])
    assert all(np.allclose(b - 0.1, v.numpy()) for b, v in zip(before, model.trainable_weights))


@pytest.mark.slow
def test_a_bucket_size_of_zero_is_one_line_and_exit_2(tmp_path):
    p = tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path / 'run'}",
               "--config.strategy.name=multi_worker_mirrored", "--config.strategy.bucket_mb=0",
               check=False)
    assert_usage_error(p, "config key 'strategy.bucket_mb' must be a gradient bucket size in MiB")
    assert not (tmp_path / "run").exists()


def _event(name, op_type, start, end):
    return profiling.Event(name, op_type, start, end, "tf_Compute/0")


def test_overlap_is_read_from_the_order_of_the_trace():
    backward = [_event(f"gradient_tape/h_{i}/MatMul", "MatMul", 10.0 * i, 10.0 * i + 9)
                for i in range(4)]
    loss_mean = _event("CollectiveReduceV2", "CollectiveReduceV2", 0.0, 50.0)  # not a gradient's
    early = [_event("tfdist_reduce/CollectiveReduceV2", "CollectiveReduceV2", 12.0, 20.0),
             _event("tfdist_reduce_1/CollectiveReduceV2", "CollectiveReduceV2", 21.0, 45.0)]
    r = profiling.overlap(backward + early + [loss_mean])
    assert r["backward_end_us"] == 39.0 and r["backward_ops"] == 4
    assert r["issued_during_backward"] == 2 and r["completed_during_backward"] == 1
    assert r["hidden_fraction"] == pytest.approx((8 + 18) / (8 + 24))
    assert r["exposed_communication_us"] == 6.0
    late = [_event("tfdist_reduce/CollectiveReduceV2", "CollectiveReduceV2",
                   40.0, 60.0)]  # one, after
    r = profiling.overlap(backward + late)
    assert (r["issued_during_backward"], r["completed_during_backward"],
            r["hidden_fraction"]) == (0, 0, 0.0)
    with pytest.raises(ValueError, match="0 gradient all-reduce"):
        profiling.overlap(backward)


def test_chrome_trace_has_one_process_per_worker():
    events = [_event("gradient_tape/MatMul", "MatMul", 1.0, 3.5),
              _event("tfdist_allreduce/HorovodGroupedAllreduce_a", "HorovodGroupedAllreduce",
                     2.0, 4.0)]
    trace = profiling.chrome_trace({0: events, 1: events})
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and len(spans) == 4
    assert spans[0] == {"ph": "X", "name": "gradient_tape/MatMul", "cat": "MatMul", "pid": 0,
                        "tid": "tf_Compute/0", "ts": 1.0, "dur": 2.5,
                        "args": {"type": "MatMul", "backward": True, "gradient_all_reduce": False}}
    assert spans[1]["args"]["gradient_all_reduce"] is True
