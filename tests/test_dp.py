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
from tfdist.parallel.dp import hierarchy
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

    return Collectives(hosts, reduce_scatter, all_reduce, all_gather, 1.0)


def _sums(placement, values, leave_out=()):
    exchange, out = _Exchange(), {}

    def worker(r):
        c = _thread_collectives(Hosts(tuple(placement), r), exchange, leave_out)
        out[r] = hierarchy.sum_tensors([tf.constant(v) for v in values[r]], c, "g")

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(placement))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


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


# -- 2 hosts x 2 workers --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    "multi_worker_mirrored", pytest.param("horovod", marks=pytest.mark.horovod)])
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
