"""A user's own Keras program (launchers/examples/keras_cnn.py) under every strategy, with only the
strategy's name changed: a Sequential CNN with BatchNormalization and Dropout, a functional model
with 2 inputs and 2 outputs, and a subclassed model. Each trains with `fit` (validation data and
EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, BackupAndRestore, CSVLogger and TensorBoard),
then runs `evaluate`, `predict` and `save`, and the chief reloads the saved file on one device.

Every process runs in its own working directory (tests/support/own_dir.py), so the program's
relative paths show who wrote what: only the chief may. `--min_delta=1e9` makes EarlyStopping
stop, and ReduceLROnPlateau halve the rate, after the second epoch, in every process.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, assert_usage_error, run

PROGRAM = os.path.join(ROOT, "launchers", "examples", "keras_cnn.py")
MODELS = ("cnn", "functional", "subclassed")
ROWS = 8 * 64  # rows of the global batches of one epoch
VAL_ROWS = 2 * 64  # rows of its validation set (keras_cnn.py)
OWN_DIR = os.path.join(ROOT, "tests", "support", "own_dir.py")  # a directory per process
TIMEOUT = 420


def launch(strategy):
    """The command that starts `strategy`'s processes, each running what follows it."""
    python = [sys.executable]
    if strategy in ("single", "mirrored"):
        return python
    flags = {"multi_worker_mirrored": ["--workers=2"],
             "horovod": ["--strategy=horovod", "--workers=2"],
             "parameter_server": ["--strategy=parameter_server", "--workers=2", "--ps=1"]}[strategy]
    return python + ["-m", "tfdist", "launch", *flags, "--max_restarts=0", "--"] + python


def run_program(strategy, base, models=MODELS, env=None, extra=()):
    """Runs the program under `strategy` (with `extra` flags); returns ({(task dir, model):
    result}, output)."""
    tmp = base / "tmp"
    tmp.mkdir(parents=True)
    argv = launch(strategy) + [OWN_DIR, str(base), PROGRAM,
                               f"--strategy={strategy}", "--devices=2", "--epochs=3",
                               "--min_delta=1e9", "--models=" + ",".join(models), *extra]
    p = run(argv, timeout=TIMEOUT, check=False, env={"TMPDIR": str(tmp), **(env or {})})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    results = {}
    for line in out.splitlines():
        if "RESULT " in line:
            r = json.loads(line.split("RESULT ", 1)[1])
            results[r["worker"], r["chief"], r["model"]] = r
    return results, out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    results, _ = run_program("single", tmp_path_factory.mktemp("single"))
    return {model: r for (_, _, model), r in results.items()}


def check_every_process(results, processes):
    """Callbacks acted everywhere, every process ran every model, and its History holds each
    compiled metric."""
    assert len(results) == processes * len(MODELS), sorted(results)
    for r in results.values():
        assert r["epochs_run"] == 2, r  # EarlyStopping ended every process after epoch 2
        assert r["learning_rate"] == pytest.approx(0.005), r  # ReduceLROnPlateau: 0.01 -> 0.005
        check_history_holds_the_compiled_metrics(r)


def check_history_holds_the_compiled_metrics(r):
    """fit's History holds every metric evaluate reports (the compiled loss(es) and metrics), for
    training and for validation."""
    wanted = set(r["evaluate"]) | {f"val_{k}" for k in r["evaluate"]}
    assert wanted <= set(r["history_keys"]), (r["model"], sorted(wanted - set(r["history_keys"])))


def test_the_history_check_finds_a_missing_metric():
    """The companion: a History with only the loss (the parameter server's `fit`, before) fails."""
    with pytest.raises(AssertionError, match="accuracy"):
        check_history_holds_the_compiled_metrics({
            "model": "cnn", "evaluate": {"loss": 1.0, "accuracy": 0.5},
            "history_keys": ["loss", "val_accuracy", "val_loss"]})


def check_only_the_chief_wrote(base, models=MODELS):
    """Only the chief's directory holds files: also the model a user's callback saves inside
    `fit` (`callback.keras`), which every rank wrote while Keras's methods called inside `fit`
    were not routed (Horovod's ranks then wrote one shared file at once: a corrupt zip)."""
    dirs = {d.name: d for d in base.iterdir() if d.name != "tmp"}
    chief = next(n for n in dirs if n in ("single", "chief0", "worker0", "rank0"))
    for name, d in dirs.items():
        if name != chief:
            assert not any(d.rglob("*")), f"{name} wrote {sorted(map(str, d.rglob('*')))}"
    for model in models:
        out = dirs[chief] / "keras_cnn_out" / model
        assert sorted(p.name for p in out.iterdir()) == [  # (the backup deleted)
            "callback.keras", "epoch1.keras", "epoch2.keras", "log.csv", "model.keras",
            "tensorboard"]
        assert len((out / "log.csv").read_text().splitlines()) == 3  # header + 2 epochs
        assert any((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert not list((base / "tmp").glob("tfdist-*")), "temporary directories left behind"


def check_synchronous(results, single, bn_synchronised):
    """Same global batches as `single`: equal losses on the models without Dropout and BN, and
    every process holds the same weights (also BatchNormalization's statistics where the strategy
    synchronises them: Horovod; under tf.distribute they are per replica, as in Keras)."""
    for model in MODELS:
        mine = [r for (_, _, m), r in results.items() if m == model]
        if model != "cnn" or bn_synchronised:
            assert len({r["weights_sha256"] for r in mine}) == 1, f"{model}: weights differ"
        if model == "cnn":
            continue
        for r in mine:
            for key in ("loss", "val_loss"):
                assert r[key] == pytest.approx(single[model][key], abs=1e-5), (model, key)
            assert r["predict_sum"] == pytest.approx(single[model]["predict_sum"], rel=1e-5)
            for k, v in single[model]["evaluate"].items():
                if k.endswith("rows"):
                    continue
                # An accuracy counts argmaxes: a row whose two largest logits are within rounding
                # of each other may go either way on another computation path (another CPU's
                # kernels), so one row of the validation set is allowed; the losses are exact.
                bound = 1 / VAL_ROWS + 1e-6 if k.endswith("accuracy") else 1e-5
                assert r["evaluate"][k] == pytest.approx(v, abs=bound), (model, k)


def check_rows_split(results, processes):
    """Each process trained on 1/processes of each global batch (the last epoch's rows)."""
    for r in results.values():
        assert r["rows_last_epoch"] == ROWS / processes, r


def check_chief_reload(results, bn_exact):
    """The saved file predicts as the trained model did (the CNN's BatchNormalization: the file
    holds the first replica's statistics, which predicted only its rows, unless synchronised)."""
    chiefs = [r for (_, chief, _), r in results.items() if chief]
    assert len(chiefs) == len(MODELS)
    for r in chiefs:
        exact = r["model"] != "cnn" or bn_exact
        assert r["reload_max_diff"] < (1e-5 if exact else 0.05), r


@pytest.mark.slow
def test_single(single, tmp_path):
    for model in MODELS:
        assert single[model]["rows_last_epoch"] == ROWS
        assert single[model]["reload_max_diff"] == 0.0
        assert single[model]["epochs_run"] == 2
        check_history_holds_the_compiled_metrics(single[model])


CASES = {"mirrored": 1, "multi_worker_mirrored": 2, "horovod": 2, "parameter_server": 1}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    "mirrored", "multi_worker_mirrored",
    pytest.param("horovod", marks=pytest.mark.horovod), "parameter_server"])
def test_the_same_program_under_every_strategy(strategy, single, tmp_path):
    results, out = run_program(strategy, tmp_path)
    assert not any(r["weights_sharded"] for r in results.values())
    processes = CASES[strategy]
    check_every_process(results, processes)
    check_only_the_chief_wrote(tmp_path)
    check_chief_reload(results, bn_exact=strategy in ("horovod", "parameter_server"))
    if strategy != "parameter_server":  # asynchronous: its losses are its own
        check_synchronous(results, single, bn_synchronised=strategy == "horovod")
    if strategy in ("multi_worker_mirrored", "mirrored"):
        check_rows_split(results, 1)  # the metric's variable sums over replicas
    if strategy == "horovod":
        check_rows_split(results, 2)
    if strategy == "parameter_server":
        assert "serving at" in out  # the servers: tfdist's own, not the program (it has no serve())
        assert {r["worker"] for r in results.values()} == {0} and all(
            chief for (_, chief, _) in results)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [  # (Horovod: long, the suite's time; the same ZeRO-3)
    pytest.param("horovod", marks=[pytest.mark.horovod, pytest.mark.long]),
    "multi_worker_mirrored"])
def test_the_same_program_with_its_weights_sharded(single, tmp_path, strategy):
    """`tfdist.strategies.get(strategy, zero=3)` (ZeRO-3, tfdist/parallel/zero/weights.py), the
    program otherwise unchanged: each weight stored on one process while `fit` runs, gathered where
    each layer runs. The three models train as under plain data parallelism: the single device's
    losses, evaluation and predictions (the models without Dropout and BatchNormalization), every
    callback acting, the weights joined after `fit` identical on both processes, the chief's saved
    files reloading to the same predictions. (Under multi_worker_mirrored the second model failed,
    "Shape mismatch in the collective instance", while its collectives reused the first model's
    keys: `test_zero3.py::test_each_sharded_model_has_collectives_of_its_own`.)"""
    results, out = run_program(strategy, tmp_path, extra=["--zero=3"])
    assert all(r["weights_sharded"] for r in results.values())  # (False without --zero=3)
    check_every_process(results, 2)
    check_only_the_chief_wrote(tmp_path)
    synchronised = strategy == "horovod"  # BatchNormalization's statistics (as plain)
    check_chief_reload(results, bn_exact=synchronised)
    check_synchronous(results, single, bn_synchronised=synchronised)


@pytest.mark.slow
@pytest.mark.horovod
def test_without_routing_horovod_ranks_read_whole_batches(tmp_path):
    """Companion: without tfdist's routing of Keras's methods (the previous behaviour) each rank
    trains on every row of every batch and nothing is all-reduced; the check above fails."""
    results, _ = run_program("horovod", tmp_path, models=("functional",),
                             env={"TFDIST_DISABLE_PATCHES": "keras_methods_follow_the_strategy"})
    with pytest.raises(AssertionError):
        check_rows_split(results, 2)
    assert all(r["rows_last_epoch"] == ROWS for r in results.values())
    with pytest.raises(AssertionError, match="rank1 wrote"):  # every rank saves
        check_only_the_chief_wrote(tmp_path, models=("functional",))


# -- bad use: one line, exit 2, within a bound ---------------------------------------------------

BAD_USE = r"""
import sys, keras, numpy as np, tensorflow as tf, tfdist.strategies
case = sys.argv[1]
strategy = tfdist.strategies.get(sys.argv[2], devices=2)
x = np.ones((60, 4), "float32")
optimizer = keras.optimizers.SGD(0.1)  # built outside the scope
if case == "trained_optimizer":
    optimizer.build([keras.Variable(np.zeros(4, "float32"))])
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1]))
if case == "unknown_batch":
    ds = ds.batch(30)  # the last batch may be short: its size is unknown
else:
    ds = ds.batch(15 if case == "odd_batch" else 30, drop_remainder=True)
if case == "arrays":
    ds, kwargs = x, dict(y=x[:, :1], batch_size=30)
else:
    ds, kwargs = ds.repeat(), dict(steps_per_epoch=2)
print("RESULT", model.fit(ds, epochs=2, verbose=0, **kwargs).history["loss"], flush=True)
"""


def bad_use(tmp_path, case, strategy, horovod=False, env=None):
    prog = tmp_path / "bad_use.py"
    prog.write_text(BAD_USE)
    argv = [sys.executable, str(prog), case, strategy]
    if horovod:
        argv = launch("horovod") + argv[1:]
    return run(argv, timeout=60, check=False, env=env)


@pytest.mark.slow
def test_an_optimizer_built_outside_the_scope_is_rebuilt_or_refused(tmp_path):
    p = bad_use(tmp_path, "fresh_optimizer", "mirrored")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rebuilt from its config" in p.stderr and "RESULT" in p.stdout  # TF: "Mixing different
    # tf.distribute.Strategy objects" without it
    assert_usage_error(bad_use(tmp_path, "trained_optimizer", "mirrored"),
                       "built outside strategy.scope()")


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.parametrize("case, needle", [("unknown_batch", "batch size is unknown"),
                                          pytest.param("odd_batch", "batch size is 15",
                                                       marks=pytest.mark.long)])  # (time)
def test_a_dataset_horovod_cannot_split_is_one_line(tmp_path, case, needle):
    p = bad_use(tmp_path, case, "horovod", horovod=True)
    assert p.returncode != 0
    errors = [line for line in (p.stdout + p.stderr).splitlines()
              if line.startswith("[r") and "tfdist: error:" in line]
    # Each rank raises it; the first rank's exit makes horovodrun end the other, which on a busy
    # machine may not have printed yet (seen in full suites: rank 0 alone, and rank 1 alone).
    assert 1 <= len(errors) <= 2 and all(needle in e for e in errors), p.stdout[-3000:]
    assert "Traceback" not in "\n".join(
        line for line in p.stdout.splitlines() if line.startswith("[r"))


@pytest.mark.slow
@pytest.mark.horovod
def test_arrays_horovod_does_not_split_are_said_once(tmp_path):
    p = bad_use(tmp_path, "arrays", "horovod", horovod=True)
    assert p.returncode == 0, p.stdout[-3000:]
    out = p.stdout + p.stderr
    notes = [line for line in out.splitlines() if "is not split over the 2 ranks" in line]
    assert len(notes) == 1 and notes[0].startswith("[r0]"), out[-3000:]  # the chief's only
    assert out.count("RESULT") == 2


@pytest.mark.slow
def test_a_chief_whose_tasks_never_start_fails_in_one_line(tmp_path):
    from tfdist.launch.local import free_ports
    ports = iter(free_ports(4))  # nothing listens on them
    cluster = {role: [f"127.0.0.1:{next(ports)}" for _ in range(n)]
               for role, n in (("chief", 1), ("worker", 2), ("ps", 1))}
    env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}),
           "TFDIST_PS_CONNECT_TIMEOUT": "5"}
    p = bad_use(tmp_path, "drop", "parameter_server", env=env)
    assert_usage_error(p, "did not answer within 5 s")


@pytest.mark.slow
def test_a_program_without_serve_lines_serves_on_the_server_tasks(tmp_path):
    """Started by hand on every task of a parameter-server cluster (no launcher), a program with
    no `strategy.serve()` serves on the worker and ps tasks inside `tfdist.strategies.get`, and
    trains on the chief (before, the workers trained alone and the chief waited forever)."""
    from tfdist.launch.local import free_ports
    prog = tmp_path / "bad_use.py"
    prog.write_text(BAD_USE)
    ports = iter(free_ports(4))
    cluster = {role: [f"127.0.0.1:{next(ports)}" for _ in range(n)]
               for role, n in (("chief", 1), ("worker", 2), ("ps", 1))}
    procs = {}
    try:
        for role, n in (("ps", 1), ("worker", 2), ("chief", 1)):
            for i in range(n):
                env = {**os.environ, "TFDIST_SERVER_ORPHAN_TIMEOUT": "2", "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": role, "index": i}})}
                with open(tmp_path / f"{role}{i}.log", "w") as log:  # files: a full pipe
                    procs[role, i] = subprocess.Popen(  # would block the task writing to it
                        [sys.executable, str(prog), "drop", "parameter_server"], cwd=ROOT,
                        env=env, stdout=log, stderr=subprocess.STDOUT)
        procs["chief", 0].wait(timeout=180)
        for p in procs.values():  # servers end once the chief has been gone for 2 s (if they
            try:  # saw it come up; else this test stops them)
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        outs = {(role, i): (tmp_path / f"{role}{i}.log").read_text() for role, i in procs}
    finally:
        for p in procs.values():  # only what this test started
            if p.poll() is None:
                p.kill()
                p.wait()
    chief = outs["chief", 0]
    assert procs["chief", 0].returncode == 0 and "RESULT" in chief, chief[-3000:]
    for task in (("worker", 0), ("worker", 1), ("ps", 0)):
        assert procs[task].returncode in (0, -9) and "serving at" in outs[task], outs[task][-3000:]
        assert "RESULT" not in outs[task]  # it did not go on to train alone


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    "multi_worker_mirrored",  # the other two repeat it (30 s each): `make test-long` runs them
    pytest.param("horovod", marks=[pytest.mark.horovod, pytest.mark.long]),
    pytest.param("parameter_server", marks=pytest.mark.long)])
def test_keras_backup_and_restore_resumes_every_process(strategy, tmp_path):
    """Keras's BackupAndRestore in a shared directory: the chief's backup of epoch 1 (the run
    then ends) is restored by every process, which all train epochs 2 and 3 only, to the same
    losses as a run never interrupted (the parameter server, asynchronous: its coordinator
    resumes at epoch 2)."""
    models = ("subclassed",)  # built by tfdist before fit: Keras restores into built models only
    shared = ["--out=" + str(tmp_path / "shared")]

    def run(base, env=None, check=True):
        argv = launch(strategy) + [OWN_DIR, str(base), PROGRAM,
                                   f"--strategy={strategy}", "--epochs=3",
                                   "--models=" + ",".join(models), *shared]
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                           env={**os.environ, **(env or {})})
        assert (p.returncode == 0) == check, (p.stdout + p.stderr)[-4000:]
        return {(r["worker"], r["model"]): r for r in map(
            lambda line: json.loads(line.split("RESULT ", 1)[1]),
            filter(lambda line: "RESULT " in line, p.stdout.splitlines()))}

    whole = run(tmp_path / "whole")
    run(tmp_path / "interrupted", env={"TFDIST_TEST_EXIT_AFTER_EPOCH": "1"}, check=False)
    resumed = run(tmp_path / "resumed")
    processes = 1 if strategy == "parameter_server" else 2  # the program runs on the chief only
    assert len(resumed) == processes * len(models)
    for (worker, model), r in resumed.items():
        assert r["epochs_run"] == 2, r  # epochs 2 and 3: epoch 1 came from the backup
        if strategy == "parameter_server":
            continue
        assert r["loss"] == pytest.approx(whole[worker, model]["loss"][1:], abs=1e-5), r
        assert r["weights_sha256"] == resumed[0, model]["weights_sha256"]
