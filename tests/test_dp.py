"""Data-parallel communication (tfdist/parallel/dp/, `config.dp`): the hosts' groups for any
placement, the hierarchical sum equal to the flat one (workers as threads), bad input in one
line, and 4 workers on 2 hosts (127.0.0.1 and 127.0.0.2, each with an agent of its own) training
with the hierarchy under multi_worker_mirrored and horovod as one process does."""
import json
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    DRIVER,
    assert_usage_error,
    driver_group,
    hashes,
    in_threads,
    losses,
    max_diff,
    reference_run,
    run_group,
    tagged,
    tfdist,
    weights,
)
from tfdist import config, strategies
from tfdist.errors import UsageError
from tfdist.parallel import dp
from tfdist.parallel.dp import compression, hierarchy
from tfdist.parallel.dp.collectives import Collectives
from tfdist.parallel.dp.hosts import Hosts

HOSTS = "127.0.0.1,127.0.0.2"


# -- groups ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["aabb", "abab", "abba", "aaabbbccc", "abcabc"])
def test_every_worker_is_in_one_local_and_one_cross_group_whatever_the_placement(placement):
    n = len(placement)
    every = [Hosts(tuple(placement), r) for r in range(n)]
    locals_ = {h.local for h in every}
    crosses = {h.cross for h in every}
    hosts = len(set(placement))
    assert len(locals_) == hosts and len(crosses) == n // hosts
    assert sorted(r for g in locals_ for r in g) == list(range(n))  # a partition
    assert sorted(r for g in crosses for r in g) == list(range(n))
    for h in every:
        assert all(placement[r] == placement[h.rank] for r in h.local)
        assert len({placement[r] for r in h.cross}) == hosts  # one per host
        assert h.rank in h.local and h.rank in h.cross


def test_uneven_hosts_have_no_workers_per_host():
    assert Hosts(tuple("aab"), 0).per_host == 0
    assert dp.Settings("auto").route(Hosts(tuple("aab"), 0)) == "flat"
    with pytest.raises(UsageError, match="several hosts with several workers each"):
        dp.Settings("host").route(Hosts(tuple("aab"), 0))


# -- the hierarchical sum, workers as threads -----------------------------------------------------
class _Exchange:
    """What each member of a group posted under a collective's name, once all have."""

    def __init__(self):
        self.cond = threading.Condition()
        self.posts = {}

    def gather(self, key, members, rank, x):
        with self.cond:
            self.posts.setdefault(key, {})[rank] = x
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: len(self.posts[key]) == len(members), timeout=60)
            return [self.posts[key][m] for m in members]


def _thread_collectives(hosts, exchange, leave_out=()):
    """`Collectives` of one worker among threads; a group in `leave_out` does not sum (a
    route that skips that phase)."""
    def members(group):
        return {"all": tuple(range(len(hosts.of_worker))), "local": hosts.local,
                "cross": hosts.cross}[group]

    def posted(x, group, name):
        m = members(group)
        return m, exchange.gather((name, m), m, hosts.rank, np.asarray(x))

    def reduce_scatter(x, group, name):
        m, every = posted(x, group, name)
        return tf.constant(sum(every)[m.index(hosts.rank)])

    def all_reduce(x, group, name):
        if group in leave_out:
            return x
        return tf.constant(sum(posted(x, group, name)[1]))

    def all_gather(x, group, name):
        return tf.constant(np.concatenate(posted(x, group, name)[1]))

    def all_to_all(x, group, name):
        m, every = posted(x, group, name)
        return tf.constant(np.stack([rows[m.index(hosts.rank)] for rows in every]))

    return Collectives(hosts, reduce_scatter, all_reduce, all_gather, all_to_all, 1.0)


def _sums(placement, values, leave_out=()):
    exchange = _Exchange()

    def worker(r):
        c = _thread_collectives(Hosts(tuple(placement), r), exchange, leave_out)
        return hierarchy.sum_tensors([tf.constant(v) for v in values[r]], c, "g")

    return in_threads(len(placement), worker)


@pytest.mark.parametrize("placement", ["aabb", "abab", "abcabc"])
def test_the_hierarchical_sum_is_the_flat_sum_on_every_worker(placement):
    """Every worker ends with the sum over all workers, of tensors whose sizes the local group
    does not divide (13 and 3 x 5 elements: the reduce-scatter pads)."""
    rng = np.random.default_rng(0)
    values = [[rng.normal(size=13).astype(np.float32),
               rng.normal(size=(3, 5)).astype(np.float32)] for _ in placement]
    sums = _sums(placement, values)
    for k in range(2):
        flat = sum(np.float64(v[k]) for v in values)
        for r in range(len(placement)):
            assert sums[r][k].shape == values[r][k].shape
            np.testing.assert_allclose(sums[r][k].numpy(), flat, rtol=0, atol=1e-5)


def test_without_the_phase_across_hosts_the_sum_is_only_the_hosts():
    """The companion: a route that leaves out the all-reduce across the hosts sums each host's
    workers only, and the comparison above catches it."""
    values = [[np.full(4, r + 1.0, np.float32)] for r in range(4)]
    sums = _sums("abab", values, leave_out=("cross",))
    assert sums[0][0].numpy().tolist() == [4.0] * 4  # workers 0 and 2: 1 + 3, not 10


# -- compression with error feedback, workers as threads ------------------------------------------
SHAPES = [(24, 16), (16,), (32, 12)]  # two matrices PowerSGD compresses, a vector it does not


def _compressed_run(kind, steps, grads_of, workers=4, drop_errors=False, **options):
    """`steps` updates of `workers` threads, each summing `grads_of(step, rank)` (a list, one
    per SHAPES) through a `Compression`; returns {rank: (the sums of every step, the final
    errors)}. `drop_errors`: each error set to zero after every step (no feedback)."""
    exchange = _Exchange()
    variables = [tf.Variable(tf.zeros(s), name=f"v{k}") for k, s in enumerate(SHAPES)]

    def worker(r):
        c = _thread_collectives(Hosts(("a",) * workers, r), exchange)
        comp = compression.Compression(kind, **options)
        sums = []
        for step in range(steps):
            out = comp.sum_tensors([tf.constant(g) for g in grads_of(step, r)], variables, c,
                                   f"b{step}")
            comp.count()
            sums.append([o.numpy() for o in out])
            if drop_errors:
                for name, v in comp.state.items():
                    if "/error/" in name:
                        v.assign(tf.zeros_like(v))
        errors = {name.rsplit("/", 1)[1]: v.numpy() for name, v in comp.state.items()
                  if "/error/" in name}
        return sums, errors

    return in_threads(workers, worker)


def _random_grads(step, rank):
    rng = np.random.default_rng(1000 * step + rank)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("kind", ["bf16", "powersgd"])
def test_compressed_sums_lose_nothing_but_what_the_errors_hold(kind):
    """Error feedback: over 6 updates, each matrix's summed output plus the workers' final
    errors is the sum of every gradient given (PowerSGD: exactly, up to float rounding; bf16:
    up to the rounding of each step's sum to bf16, not fed back). Every worker gets the same
    sums, bit for bit; the vector goes uncompressed; the first 2 PowerSGD updates (its warm
    start) are plain sums."""
    steps = 6
    out = _compressed_run(kind, steps, _random_grads, rank=2, start=2)
    given = [sum(np.float64(_random_grads(t, r)[k]) for t in range(steps) for r in range(4))
             for k in range(len(SHAPES))]
    for r in range(1, 4):
        for t in range(steps):
            for k in range(len(SHAPES)):
                assert np.array_equal(out[r][0][t][k], out[0][0][t][k])
    for k in (0, 2):  # the matrices
        sent = sum(np.float64(out[0][0][t][k]) for t in range(steps))
        held = sum(np.float64(out[r][1][f"v{k}"]) for r in range(4))
        tolerance = 1e-4 if kind == "powersgd" else 0.05  # (6 sums of ~4 rounded to 2^-8)
        np.testing.assert_allclose(sent + held, given[k], rtol=0, atol=tolerance)
        assert np.abs(held).max() > (10 * tolerance if kind == "powersgd" else 1e-3)  # (held)
    np.testing.assert_allclose(sum(np.float64(out[0][0][t][1]) for t in range(steps)), given[1],
                               rtol=0, atol=1e-4)  # the vector: plain
    if kind == "powersgd":
        for t in range(2):
            plain = [sum(np.float64(_random_grads(t, r)[k]) for r in range(4)) for k in (0, 2)]
            for k, p in zip((0, 2), plain):
                np.testing.assert_allclose(out[0][0][t][k], p, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["bf16", "powersgd"])
def test_without_error_feedback_what_is_not_sent_is_lost(kind):
    """The companion: with each error dropped after its step, a gradient bf16 cannot hold
    (1 + 2^-9, rounded to 1 on every step) or one PowerSGD's rank 1 cannot (a rank-2 matrix)
    falls short of the sum by the same amount every step; with feedback the shortfall (what the
    errors hold) stays bounded."""
    def grads(step, rank):
        if kind == "bf16":
            return [np.full(s, 1 + 2.0 ** -9, np.float32) for s in SHAPES]
        a = np.zeros(SHAPES[0], np.float32)
        a[0, 0], a[1, 1] = 1.0, 0.5  # rank 2
        return [a, np.zeros(SHAPES[1], np.float32), np.zeros(SHAPES[2], np.float32)]

    steps = 40
    given = sum(np.float64(grads(t, r)[0]) for t in range(steps) for r in range(4))
    shortfall = {}
    for drop in (False, True):
        out = _compressed_run(kind, steps, grads, drop_errors=drop, rank=1, start=0)
        sent = sum(np.float64(out[0][0][t][0]) for t in range(steps))
        shortfall[drop] = np.abs(given - sent).max()
    assert shortfall[True] > 4 * shortfall[False], shortfall


# -- bad input ------------------------------------------------------------------------------------
def test_a_bad_hierarchy_value_names_the_key():
    c = config.default_config()
    c.dp.hierarchy = "ring"
    with pytest.raises(UsageError, match=r"'dp\.hierarchy' must be one of auto, flat, host"):
        config.validate(c)


def test_hierarchy_under_a_strategy_that_does_not_route_is_refused():
    with pytest.raises(UsageError, match="dp.hierarchy=host under strategy single"):
        strategies.get("single", hierarchy="host")
    assert strategies.get("single", hierarchy="auto").dp.hierarchy == "auto"


def test_hierarchy_with_one_worker_per_host_is_one_line_and_exit_2(tmp_path):
    p = tfdist("launch", "--workers=2", f"--hosts={HOSTS}", "--max_restarts=0", "--",
               "--config=configs/gpt_nano.py", "--config.dp.hierarchy=host",
               f"--workdir={tmp_path / 'w'}", check=False)
    assert_usage_error(p, "dp.hierarchy=host needs several hosts with several workers each "
                          "(here 2 worker(s) on 2 host(s) (1, 1))")


def test_powersgd_under_the_parameter_server_is_one_line_and_exit_2(tmp_path):
    p = tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
               "--config.strategy.name=parameter_server", "--config.dp.compression=powersgd",
               check=False)
    assert_usage_error(p, "dp.compression=powersgd under strategy parameter_server")


@pytest.mark.parametrize("options, needle", [
    (dict(compression="int8"), "'dp.compression' must be one of none, fp16, bf16, powersgd"),
    (dict(compression="fp16"), "dp.compression=fp16 is Horovod's own"),
    (dict(compression="powersgd", powersgd_rank=0), "'dp.powersgd_rank' must be an integer > 0"),
    (dict(compression="bf16", hierarchy="host"), "dp.hierarchy=host with dp.compression=bf16"),
    (dict(compression="bf16", zero=3), "dp.compression=bf16 with ZeRO stage 3"),
])
def test_compression_that_cannot_run_is_refused_in_one_line(options, needle):
    with pytest.raises(UsageError, match=needle.replace(".", r"\.")):
        strategies.get("multi_worker_mirrored", **options)


# -- compressed runs resume exactly ---------------------------------------------------------------
COMPRESSED = {"train.steps": 10, "train.steps_per_epoch": 10, "train.batch_size": 16,
              "train.deterministic": True, "backup.every_steps": 1, "strategy.bucket_mb": 0.1,
              "dp.powersgd_rank": 2, "dp.powersgd_start": 3}


def _compressed(workdir, data_dir, strategy, kind, *extra, check=True, **more):
    o = {**COMPRESSED, "data.data_dir": data_dir, "strategy.name": strategy,
         "dp.compression": kind, **more}
    return driver_group(workdir, o, "--hash-weights", "--dump-weights", *extra, check=check,
                        max_restarts=1)


@pytest.fixture(scope="module")
def powersgd_mwms(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("powersgd-mwms")
    _compressed(d, data_dir, "multi_worker_mirrored", "powersgd")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("strategy, kind, accumulate", [
    ("multi_worker_mirrored", "powersgd", 1),  # (the others long: the suite's time)
    pytest.param("horovod", "bf16", 2, marks=[pytest.mark.horovod, pytest.mark.long]),
    pytest.param("multi_worker_mirrored", "bf16", 2, marks=pytest.mark.long),
    pytest.param("horovod", "powersgd", 1, marks=[pytest.mark.horovod, pytest.mark.long])])
def test_a_killed_compressed_run_resumes_bitwise(tmp_path, data_dir, request, strategy, kind,
                                                 accumulate):
    """Worker 1 SIGKILLed after step 6 (PowerSGD compressing since step 4, its errors and Q
    in every worker's own shard of the backup); the group restarts, resumes at step 6 and ends
    with the weights of the run never killed, bit for bit, equal on both workers. In 0.1 MiB
    buckets (several compressed sums a step); bf16 with 2 batches per update."""
    more = {"train.grad_accum_steps": accumulate, "backup.every_steps": accumulate}
    if (strategy, kind) == ("multi_worker_mirrored", "powersgd"):
        whole = request.getfixturevalue("powersgd_mwms")
    else:
        whole = tmp_path / "whole"
        _compressed(whole, data_dir, strategy, kind, **more)
    run = tmp_path / "run"
    p = _compressed(run, data_dir, strategy, kind, "--kill-at-step", "6", "--kill-worker", "1",
                    **more)
    assert "at step 6 of 10" in p.stdout, p.stdout[-3000:]
    assert "error feedback starts at zero" not in p.stdout + p.stderr
    assert max_diff(weights(run, 0), weights(whole, 0)) == 0.0
    assert hashes(run, 0)[-1] == hashes(run, 1)[-1]


@pytest.mark.slow
def test_a_resumed_run_without_its_errors_is_caught(tmp_path, data_dir, powersgd_mwms):
    """The companion: the same kill, with the workers' errors dropped when the backup is
    restored (Q and the step count kept), ends with other weights."""
    run = tmp_path / "run"
    p = _compressed(run, data_dir, "multi_worker_mirrored", "powersgd", "--kill-at-step", "6",
                    "--kill-worker", "1", "--drop-dp-state")
    assert "at step 6 of 10" in p.stdout, p.stdout[-3000:]
    assert max_diff(weights(run, 0), weights(powersgd_mwms, 0)) > 0.0
    assert hashes(run, 0)[-1] == hashes(run, 1)[-1]  # (still equal on both workers)


# -- 2 hosts x 2 workers --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy", [  # (Horovod: long, the suite's time; the same hierarchy)
    "multi_worker_mirrored",
    pytest.param("horovod", marks=[pytest.mark.horovod, pytest.mark.long])])
def test_four_workers_on_two_hosts_train_with_the_hierarchy_as_one_process(
        tmp_path, data_dir, single_reference, strategy):
    """Workers placed round robin (127.0.0.1, .2, .1, .2: a flat ring would cross at every hop)
    reduce in each host, across the hosts and gather again: per-step losses within 1e-5 of one
    process with the global batch (as the flat all-reduce's are: tests/test_multi_worker.py),
    weights bitwise equal on every worker, gradients in 0.1 MiB buckets."""
    o = {**reference_run(data_dir), "strategy.name": strategy, "dp.hierarchy": "host",
         "strategy.bucket_mb": 0.1}
    cmd = [sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}", "--workers=4",
           f"--hosts={HOSTS}", "--max_restarts=0", "--", sys.executable, DRIVER, str(tmp_path),
           json.dumps(o), "--dump-weights"]
    p = run_group(cmd, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    prefix = r"\[r(\d+)\] " if strategy == "horovod" else r"\[w(\d+)\] "
    assert set(tagged(p.stdout, "DRIVER_RESULT", prefix=prefix)) == {0, 1, 2, 3}
    assert (f"tfdist: {strategy}: hierarchical all-reduce over 4 worker(s) on 2 host(s) (2, 2)"
            in p.stdout)
    assert "4 bucket(s) of <= 0.1 MiB" in p.stdout
    a, b = losses(single_reference), losses(tmp_path)
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    for w in (1, 2, 3):
        assert max_diff(weights(tmp_path, 0), weights(tmp_path, w)) == 0.0
