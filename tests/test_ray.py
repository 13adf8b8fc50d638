"""`tfdist launch --engine=ray` (tfdist/launch/ray_train.py): tfdist's workers as Ray Train
workers, on a Ray started for the run on 127.0.0.1 (ray[train]==2.60.0, the `ray` extra, which
`make setup` installs). Its bad input is one line each, exit 2: Ray missing (the extra named), an
address nothing listens at or that never answers (bounded), a strategy Ray cannot run (those it
can named), --min_workers above --max_workers."""
import json
import socket
import sys
import time

import pytest

from tests.helpers import assert_usage_error, reference_run, run, tfdist
from tools.faults.harness import losses

NANO = "--config=configs/gpt_nano.py"


def train_flags(workdir, overrides):
    return [NANO, f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["multi_worker_mirrored",
                                      pytest.param("horovod", marks=pytest.mark.horovod)])
def test_tfdist_train_on_ray_equals_one_process(tmp_path, data_dir, single_reference, strategy):
    """2 Ray Train workers: under multi_worker_mirrored with Ray's worker-only TF_CONFIG, under
    horovod met through Horovod's Gloo rendezvous (tfdist/launch/ray_horovod.py). Per-step
    losses equal the single process's within 1e-5; each epoch's metrics reach Ray, the last with
    the chief's pointer to the backup (Ray's checkpoint)."""
    p = tfdist("launch", "--engine=ray", f"--strategy={strategy}", "--workers=2",
               "--max_restarts=0", "--", *train_flags(tmp_path, reference_run(data_dir)),
               timeout=600)
    out = p.stdout + p.stderr
    got, want = losses(tmp_path), losses(single_reference)
    assert len(got) == len(want) == 20, out[-3000:]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    assert any(f"tfdist: {strategy}: {who} 0 of 2" in out
               for who in ("worker", "rank")), out[-3000:]  # (its one line naming the group)
    assert "tfdist launch: done: Ray Train finished the run (last reported: {'step': 20, " in out
    assert "backup pointer at step 20" in out
    *_, pointer = sorted((tmp_path / "ray" / "tfdist").glob("checkpoint_*/tfdist.json"))
    assert json.loads(pointer.read_text())["step"] == 20


# -- bad input: one line, exit 2 -------------------------------------------------------------------
def ray_launch(*args, check=False, **kw):
    return tfdist("launch", "--engine=ray", *args, "--", NANO, check=check, **kw)


def test_without_ray_the_line_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['tfdist', 'launch', "
            f"'--engine=ray', '--', '{NANO}']; from tfdist.__main__ import main; main()")
    p = run([sys.executable, "-c", code], check=False)
    assert_usage_error(p, "pip install 'tfdist[ray]'")


@pytest.mark.parametrize("args,needle", [
    (["--strategy=parameter_server"], "TF_CONFIG has worker tasks only, no chief and no ps. "
                                      "On Ray: horovod, multi_worker_mirrored;"),
    (["--strategy=single"], "tfdist launch cannot start strategy 'single'"),
    (["--min_workers=3", "--max_workers=2"], "--min_workers (3) is above --max_workers (2)"),
    (["--address=nope"], "give the Ray head's HOST:PORT"),
    (["--hosts=a,b"], "Ray places the workers"),
])
def test_what_ray_cannot_run_is_one_line(args, needle):
    assert_usage_error(ray_launch(*args), needle)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_an_address_nothing_listens_at_is_one_line():
    port = free_port()
    assert_usage_error(ray_launch(f"--address=127.0.0.1:{port}"),
                       f"cannot reach a Ray cluster at 127.0.0.1:{port} (")


@pytest.mark.slow
def test_an_address_that_never_answers_ends_within_the_bound():
    """A port that accepts and says nothing: Ray's own `ray.init` waited there for minutes (200 s
    and on, measured); tfdist gives up after 15 s (ray_train.CONNECT_TIMEOUT), once the run is
    prepared."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        start = time.monotonic()
        p = ray_launch(f"--address=127.0.0.1:{port}", timeout=120)
        took = time.monotonic() - start
    assert_usage_error(p, "no answer within 15 s")
    assert took < 60, took


# -- a user's program, written the way Ray's docs write one ---------------------------------------
PROGRAM = "launchers/ray/keras_on_ray.py"


def program_losses(tmp_path, *args):
    out = tmp_path / f"losses{len(list(tmp_path.glob('losses*')))}.json"
    p = run([sys.executable, PROGRAM, f"--out={out}", *args], timeout=600)
    [line] = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.long), 3])  # (0: time; the
# first test trains under multi_worker_mirrored with Ray's TF_CONFIG too)
def test_a_users_ray_program_equals_one_process(tmp_path, zero):
    """`TensorflowTrainer` with 2 workers whose loop takes `tfdist.strategies.get(
    "multi_worker_mirrored", zero=...)`: the per-epoch losses equal the same loop's under
    `single`, without Ray, within 1e-5 (measured: 1.2e-7 with zero=3, 1.3e-7 without)."""
    want = program_losses(tmp_path, "--no_ray", "--strategy=single")
    got = program_losses(tmp_path, "--workers=2", "--strategy=multi_worker_mirrored",
                         f"--zero={zero}")
    assert len(got) == len(want) == 3
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
