"""Local-SGD islands, DiLoCo (tfdist/parallel/dp/islands.py, exchange.py; tfdist/launch/islands.py):
the exchange's encodings and rounds (an island that leaves, one that is behind), a user's Keras
model whose islands sync after every SGD update equal to synchronous data parallelism, a killed
island's worker that rejoins, and bad input in one line."""
import json
import sys

import numpy as np
import pytest

from tests.helpers import DRIVER, ROOT, assert_usage_error, in_threads, run_group, tfdist
from tfdist import config
from tfdist.errors import UsageError
from tfdist.parallel.dp import exchange

PROGRAM = f"{ROOT}/tests/support/keras_islands.py"
SETTINGS = {"outer_lr": 0.7, "outer_momentum": 0.9, "exchange": "float32", "sync_every": 1,
            "sync_timeout": 5.0}


# -- the exchange ---------------------------------------------------------------------------------
@pytest.mark.parametrize("how, bound", [("float32", 0.0), ("bf16", 2.0 ** -8), ("int8", 1 / 127)])
def test_an_encoded_delta_comes_back_within_its_rounding(how, bound):
    x = np.random.default_rng(0).normal(size=10_000).astype(np.float32)
    data = b"".join(exchange.encode(x, how))
    assert len(data) == exchange.encoded_size(x.size, how)
    back = exchange.decode(data, x.size, how)
    scale = np.abs(x) if how == "bf16" else np.abs(x).max()
    assert np.all(np.abs(back - x) <= bound * scale + 1e-12)


def test_the_outer_step_is_nesterov_sgd():
    theta, m, d = np.ones(3, np.float32), np.zeros(3, np.float32), np.full(3, 0.5, np.float32)
    exchange.outer_step(theta, m, d, 0.7, 0.9)  # m = 0.5; theta -= 0.7 (0.5 + 0.45)
    np.testing.assert_allclose(theta, 1 - 0.7 * 0.95, rtol=1e-6)
    np.testing.assert_allclose(m, 0.5)


def _islands(n, timeout=5.0):
    server = exchange.serve_in_thread("127.0.0.1", n, timeout=timeout)
    clients = [exchange.Client(server.address, k, True, timeout=30) for k in range(n)]
    return server, clients


def _together(*calls):
    """Each of `calls` on a thread of its own, at once; their results in order."""
    out = in_threads(len(calls), lambda k: calls[k]())
    return [out[k] for k in range(len(calls))]


def test_a_round_is_the_islands_mean_and_every_party_takes_the_same_step():
    server, (a, b) = _islands(2)
    zero = np.zeros(4, np.float32)
    _together(lambda: a.hello(0, SETTINGS, zero, zero), lambda: b.hello(0, SETTINGS, zero, zero))
    got = _together(lambda: a.sync(0, np.full(4, 1.0, np.float32)),
                    lambda: b.sync(0, np.full(4, 3.0, np.float32)))
    assert [g[0] for g in got] == ["ok", "ok"]
    assert got[0][1].tolist() == got[1][1].tolist() == [2.0] * 4
    theta, m = zero.copy(), zero.copy()
    exchange.outer_step(theta, m, got[0][1], 0.7, 0.9)
    assert np.array_equal(server.rounds.theta, theta) and server.rounds.round == 1
    server.shutdown()


def test_an_island_that_leaves_is_not_waited_for_and_one_behind_gets_the_state():
    """Island b closes its connection (its process died): round 0 closes with a alone. b comes
    back (a new hello at round 0, its backup's) and is given round 1's weights."""
    server, (a, b) = _islands(2, timeout=60)
    zero = np.zeros(2, np.float32)
    _together(lambda: a.hello(0, SETTINGS, zero, zero), lambda: b.hello(0, SETTINGS, zero, zero))
    b.close()
    status, mean = a.sync(0, np.array([1.0, -1.0], np.float32))  # (not 60 s: b left)
    assert status == "ok" and mean.tolist() == [1.0, -1.0]
    b = exchange.Client(server.address, 1, True, timeout=30)
    answer = b.hello(0, SETTINGS, zero, zero)
    assert answer[0] == "behind" and answer[1] == 1
    assert np.array_equal(answer[2], server.rounds.theta)
    server.shutdown()


def test_islands_with_other_settings_are_refused():
    server, (a, b) = _islands(2)
    zero = np.zeros(2, np.float32)
    a.hello(0, SETTINGS, zero, zero)
    with pytest.raises(exchange.ExchangeError, match="settings"):
        b.hello(0, {**SETTINGS, "outer_lr": 1.0}, zero, zero)
    server.shutdown()


# -- a user's Keras model: islands that sync every update equal synchronous data parallelism -----
def _program(tmp_path, islands, *extra):
    launch = [sys.executable, "-m", "tfdist", "launch", "--workers=2", "--max_restarts=0"]
    if islands > 1:
        launch.append(f"--islands={islands}")
    p = run_group([*launch, "--", sys.executable, PROGRAM, f"--islands={islands}", *extra],
                  timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in p.stdout.splitlines()
               if "RESULT " in line]
    assert len(results) == 2, p.stdout[-3000:]
    return results, p.stdout


def _flat(result):
    return np.concatenate([np.ravel(np.array(w, np.float64)) for w in result["weights"]])


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    return _program(tmp_path_factory.mktemp("sync"), 1)[0]


@pytest.mark.slow
def test_islands_syncing_every_sgd_update_equal_synchronous_data_parallelism(tmp_path,
                                                                             synchronous):
    """2 islands of 1 worker, plain SGD inside, an outer step of lr 1 without momentum after
    every update: the mean of the islands' updates is the synchronous update. The islands'
    logged losses average to the 2-worker run's within 1e-5, their weights are bitwise equal to
    each other's and within 1e-5 of its."""
    results, out = _program(tmp_path, 2)
    assert "islands: 6 round(s) closed; rounds each island sent to: i0 6, i1 6" in out
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert max(abs(x - y) for x, y in zip(mean, synchronous[0]["losses"])) <= 1e-5
    assert np.array_equal(_flat(results[0]), _flat(results[1]))
    assert np.abs(_flat(results[0]) - _flat(synchronous[0])).max() <= 1e-5


@pytest.mark.slow
def test_with_outer_momentum_the_islands_are_not_synchronous(tmp_path, synchronous):
    """The companion: DiLoCo's outer momentum 0.9 instead of none, and the comparison above
    fails."""
    results, _ = _program(tmp_path, 2, "--outer_momentum=0.9")
    assert np.abs(_flat(results[0]) - _flat(synchronous[0])).max() > 1e-3


# -- killed islands -------------------------------------------------------------------------------
def _islands_run(workdir, data_dir, *extra, restarts=0, check=True):
    o = {"data.data_dir": data_dir, "train.steps": 12, "train.steps_per_epoch": 12,
         "train.batch_size": 16, "train.deterministic": True, "backup.every_steps": 1,
         "dp.islands": 2, "dp.sync_every": 4, "dp.exchange": "int8",
         "strategy.name": "multi_worker_mirrored"}
    cmd = [sys.executable, "-m", "tfdist", "launch", "--workers=2", "--islands=2",
           f"--max_restarts={restarts}", "--backoff=0.5", "--", sys.executable, DRIVER,
           str(workdir), json.dumps(o), "--dump-weights", *extra]
    p = run_group(cmd, timeout=600)
    assert p.returncode == 0 or not check, p.stdout[-4000:] + p.stderr[-2000:]
    return p


def _weights(workdir, island):
    with np.load(workdir / f"weights-i{island}w0.npz") as z:
        return [z[k] for k in sorted(z.files, key=lambda k: int(k.split("_")[1]))]


@pytest.fixture(scope="module")
def whole_islands(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("islands-whole")
    _islands_run(d, data_dir)
    return d


@pytest.mark.slow
def test_islands_killed_between_two_syncs_resume_exactly(tmp_path, data_dir, whole_islands):
    """Both islands (one worker each, a sync every 4 updates, int8 deltas) SIGKILLed after step
    6, between the syncs of steps 4 and 8; the same command again resumes each from its own
    backup, outer weights, momentum and round included, at a new exchange: the final weights
    are bitwise those of the run never killed, equal on both islands."""
    p = _islands_run(tmp_path, data_dir, "--kill-at-step", "6", check=False)
    assert p.returncode != 0
    _islands_run(tmp_path, data_dir)
    for island in (0, 1):
        for a, b in zip(_weights(tmp_path, island), _weights(whole_islands, island)):
            assert np.array_equal(a, b)
    for a, b in zip(_weights(whole_islands, 0), _weights(whole_islands, 1)):
        assert np.array_equal(a, b)


@pytest.mark.slow
@pytest.mark.long  # time: the resume above shows the state is kept; this shows the test sees it
def test_a_resume_without_the_outer_momentum_is_caught(tmp_path, data_dir, whole_islands):
    """The companion: the same kill and resume, but the outer momentum zeroed after the restore
    (`--drop-outer-state`): the final weights are not the run never killed's."""
    p = _islands_run(tmp_path, data_dir, "--kill-at-step", "6", check=False)
    assert p.returncode != 0
    _islands_run(tmp_path, data_dir, "--drop-outer-state")
    assert any(not np.array_equal(a, b)
               for a, b in zip(_weights(tmp_path, 0), _weights(whole_islands, 0)))


@pytest.mark.slow
def test_a_killed_island_rejoins_and_the_other_goes_on(tmp_path, data_dir):
    """Island 1's worker SIGKILLed after step 6: island 0 is not held up (it runs its 12 steps
    once), island 1's launcher restarts it from its backup and it rejoins the others' rounds with
    the current outer weights; the run ends with both islands done."""
    p = _islands_run(tmp_path, data_dir, "--kill-at-step", "6", "--kill-island", "1",
                     restarts=1)
    ran = [line.split()[0:2] for line in open(tmp_path / "executed_steps.txt")]
    assert "[i1] tfdist launch: done: 1 worker(s) finished after 1 restart(s)" in p.stdout
    assert "[i0] tfdist launch: done: 1 worker(s) finished\n" in p.stdout, p.stdout[-3000:]
    assert "[i1] [w0] tfdist: resuming from" in p.stdout and " at step 6 of 12" in p.stdout
    # (rounds closed without it while it restarted: it takes the current outer weights; had it
    # been back first, the others would have waited for it at their next sync)
    assert ("[i1] [w0] tfdist: island 1: rejoining at round" in p.stdout
            or "[i1] [w0] tfdist: island 1 of 2: meeting" in p.stdout.split("resuming from")[1])
    assert len(ran) == 12 + 6 + 6, ran  # island 0's 12, island 1's 6 and 6 after its restart


# -- bad input -----------------------------------------------------------------------------------
def test_islands_that_do_not_divide_the_workers_are_one_line(tmp_path):
    p = tfdist("launch", "--workers=3", "--max_restarts=0", "--", "--config=configs/gpt_nano.py",
               "--config.dp.islands=2", f"--workdir={tmp_path}", check=False)
    assert_usage_error(p, "dp.islands=2 does not divide --workers=3")


def test_islands_without_their_launch_are_one_line(tmp_path):
    p = tfdist("launch", "--workers=2", "--max_restarts=0", "--islands=1", "--",
               "--config=configs/gpt_nano.py", "--config.dp.islands=2", f"--workdir={tmp_path}",
               check=False)
    assert_usage_error(p, "dp.islands=2, and the run was started with `tfdist launch "
                          "--islands=1`")


@pytest.mark.parametrize("key, value, needle", [
    ("sync_every", 0, "'dp.sync_every' must be an integer > 0"),
    ("islands", 0, "'dp.islands' must be an integer > 0"),
    ("exchange", "fp8", "'dp.exchange' must be one of bf16, int8, float32"),
])
def test_bad_island_settings_name_the_key(key, value, needle):
    c = config.default_config()
    c.dp[key] = value
    with pytest.raises(UsageError, match=needle.replace(".", r"\.")):
        config.validate(c)
