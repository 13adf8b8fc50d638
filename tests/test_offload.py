"""ZeRO-Offload (tfdist/parallel/zero/offload.py, store.py): the optimizer state (ZeRO-3: and the
master weights) in host memory or in files, stepped on the CPU sub-group by sub-group. In one
process and over 2 Horovod ranks, ZeRO 1, 2 and 3 with host and disk offload give the losses and
weights of the same stage without offload; a sub-group holds values only while it is updated; the
run's weight-decay exclusions hold; an offloaded run killed mid-step resumes from its backup, also
without offload; a user's keras-hub GPT-2 trains with ZeRO-3 and disk offload; bad input (no
ZeRO, an unwritable or foreign directory, a full disk) is one line."""
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.helpers import (
    ROOT,
    assert_usage_error,
    driver_argv,
    driver_group,
    losses,
    metrics,
    run,
    tfdist,
)
from tfdist import compat
from tfdist.errors import UsageError
from tfdist.parallel import zero
from tfdist.parallel.zero.offload import Offload
from tfdist.parallel.zero.store import Store


# -- the store ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_the_store_returns_what_it_was_given(tmp_path, kind):
    store = Store(kind, str(tmp_path / "s") if kind == "disk" else None)
    arrays = {"a": np.arange(1001, dtype="float32").reshape(7, 143),  # (not a 4 KiB multiple)
              "b/c": np.float32(3.5) * np.ones((2, 2), "float32"), "i": np.arange(5)}
    for name, a in arrays.items():
        store.write_behind(name, a)
    store.prefetch(["a", "i"])
    for name, a in arrays.items():
        got = store.get(name)
        assert got.dtype == a.dtype and np.array_equal(got, a), name
    assert store.nbytes == sum(a.nbytes for a in arrays.values())
    assert store.bytes_read >= store.nbytes and store.bytes_written >= store.nbytes
    store.close()
    assert not (tmp_path / "s").exists()


def test_a_directory_of_other_files_is_refused_and_kept(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(UsageError, match="holds files that are not an offload store's"):
        Store("disk", str(tmp_path))
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_a_store_in_use_is_refused_and_a_dead_ones_emptied(tmp_path):
    """A live store holds its directory's lock: a second one is refused (nothing deleted); once
    it is closed, or its process is gone (a killed run), the next store empties it."""
    live = Store("disk", str(tmp_path / "s"))
    live.put("a", np.ones(3, "float32"))
    with pytest.raises(UsageError, match="in use by another run"):
        Store("disk", str(tmp_path / "s"))
    assert np.array_equal(live.get("a"), np.ones(3, "float32"))
    code = (f"import sys, numpy as np; sys.path.insert(0, {ROOT!r})\n"
            f"from tfdist.parallel.zero.store import Store\n"
            f"s = Store('disk', {str(tmp_path / 'dead')!r}); s.put('b', np.ones(2)); "
            f"import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert (tmp_path / "dead" / "b.bin").exists()  # (left by the process that ended)
    again = Store("disk", str(tmp_path / "dead"))
    assert not (tmp_path / "dead" / "b.bin").exists()
    again.close()
    live.close()


def _dying_after(stop, done, unlink):
    """An os.unlink that unlinks `stop` files (listed in `done`), then 'is killed'."""
    def dying(path, *args, **kwargs):
        if len(done) == stop:
            raise SystemExit("killed")
        done.append(path)
        return unlink(path, *args, **kwargs)
    return dying


def test_a_store_killed_while_removing_itself_is_still_a_stores(tmp_path, monkeypatch):
    """A run killed while its store removes its files (CI: a rank SIGKILLed in its close) leaves
    a directory the next run still empties: the marker goes last. Each point of interruption is
    tried; the removal order of the old `shutil.rmtree` (the marker anywhere) fails one."""
    unlink = os.unlink
    for stop in range(4):
        directory = str(tmp_path / f"s{stop}")
        store = Store("disk", directory)
        for name in "abc":
            store.put(name, np.ones(3, "float32"))
        done = []
        monkeypatch.setattr(os, "unlink", _dying_after(stop, done, unlink))
        with pytest.raises(SystemExit):
            store.close()
        monkeypatch.setattr(os, "unlink", unlink)
        assert os.path.exists(os.path.join(directory, ".tfdist-offload")), (stop, done)
        Store("disk", directory).close()  # (recognised, emptied, and removed)
        assert not os.path.exists(directory)


def test_a_short_or_failed_write_is_one_line(tmp_path, monkeypatch):
    store = Store("disk", str(tmp_path / "s"))
    monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: 100)
    with pytest.raises(UsageError, match="No space left on device") as e:
        store.put("a", np.ones(5000, "float32"))
    assert "\n" not in str(e.value) and store.failure is not None
    monkeypatch.undo()
    store.close()


def test_an_unwritable_directory_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="cannot be written") as e:
        Store("disk", str(tmp_path / "file" / "offload"))
    assert "\n" not in str(e.value)


# -- one process ---------------------------------------------------------------------------------
def dense_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5), keras.layers.Dense(3)])


def test_a_subgroup_holds_values_only_while_it_is_updated(tmp_path):
    """(compat row staged_storage) After the build and after an update, every stand-in and slot
    of every sub-group holds no elements: the state is in the store, Adam's two moments."""
    model = dense_model()
    offload = Offload("disk", str(tmp_path / "s"), subgroup=20)
    sharded = zero.make(1, model, zero.local(), offload=offload)
    opt = keras.optimizers.Adam(0.01)
    sharded.build(opt)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    assert len(offload.groups) == 3  # (30 | 5 | 15 + 3 parameters)
    assert offload.stored_bytes == 2 * 4 * params

    def held():
        return sum(compat.storage(x).numpy().size for g in offload.groups
                   for x in g.standins + [s for s, _ in g.slots])
    assert held() == 0
    grads = [(np.ones(v.shape, "float32"), v) for v in model.trainable_weights]
    sharded.apply(opt, *zip(*sharded.update_gradients(grads)))
    assert held() == 0 and int(opt.iterations.numpy()) == 1
    assert not opt.variables[2:]  # (the run's optimizer: its step and rate, no slots)
    offload.close()


def test_offload_keeps_the_weight_decay_exclusions(tmp_path):
    """(compat row weight_decay_choice) AdamW decays the kernels, not the biases it excludes by
    name: the offloaded update equals the resident one."""
    def step(offload):
        model = dense_model()
        opt = keras.optimizers.AdamW(0.1, weight_decay=0.5)
        opt.exclude_from_weight_decay(var_names=["bias"])
        sharded = zero.make(1, model, zero.local(), offload=offload)
        sharded.build(opt)
        grads = [(np.full(v.shape, 0.5, "float32"), v) for v in model.trainable_weights]
        sharded.apply(opt, *zip(*sharded.update_gradients(grads)))
        return [v.numpy() for v in model.trainable_weights]
    resident = step(None)
    offloaded = step(Offload("host"))
    for a, b in zip(resident, offloaded):
        assert np.allclose(a, b, rtol=0, atol=1e-7)


def gpt_fit(stage, kind, tmp_path, accumulate=1, steps=5):
    """A tiny GPT's per-step losses and final weights under ZeRO `stage` of one replica."""
    import tensorflow as tf

    import tfdist.strategies
    from tfdist import config
    from tfdist.models.gpt import GPT, loss_fn
    from tfdist.optimizers import make_optimizer
    from tfdist.parallel.layout import Layout
    from tfdist.step import TrainStep
    keras.utils.set_random_seed(1)
    strategy = tfdist.strategies.get("single")
    t = config.default_config().train
    t.learning_rate, t.warmup_steps, t.steps = 1e-2, 2, steps
    offload = None
    if kind != "none":
        offload = Offload(kind, str(tmp_path / f"{stage}-{kind}") if kind == "disk" else None,
                          subgroup=3000)
    with strategy.scope():
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        model.build()
        model.compile(optimizer=make_optimizer(t, steps), loss=loss_fn())
        TrainStep(model, strategy, Layout(zero=stage, accumulate=accumulate), clipnorm=1.0,
                  collectives=zero.local(), offload=offload).install()
    rows = np.random.default_rng(0).integers(0, 64, (8, 17)).astype("int32")
    data = tf.data.Dataset.from_tensors((rows[:, :-1], rows[:, 1:])).repeat()
    history = model.fit(data, epochs=steps, steps_per_epoch=1, verbose=0)
    weights = [w.copy() for w in zero.of(model).full_values()]
    if offload is not None:
        offload.close()
    return history.history["loss"], weights


@pytest.mark.parametrize("stage,accumulate", [
    (3, 2), pytest.param(1, 1, marks=pytest.mark.long), pytest.param(2, 2, marks=pytest.mark.long),
    pytest.param(3, 1, marks=pytest.mark.long)])
def test_one_replica_offloaded_equals_resident(tmp_path, stage, accumulate):
    """Host and disk: the resident run's losses within 1e-5 and weights within 1e-6 (measured:
    stages 1-2 bitwise; ZeRO-3 sums a weight read by two layers (the tied head) in host memory,
    ~2e-7). With gradient accumulation (2 batches per update), which the 2-rank test below does
    not cover; the other cases are `make test-long`."""
    loss, weights = gpt_fit(stage, "none", tmp_path, accumulate)
    for kind in ("host", "disk"):
        got, got_weights = gpt_fit(stage, kind, tmp_path, accumulate)
        assert max(abs(a - b) for a, b in zip(loss, got)) <= 1e-5, (kind, loss, got)
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(weights, got_weights)) <= 1e-6


def test_without_writing_the_moments_back_the_losses_differ(tmp_path, monkeypatch):
    """The companion: an offloaded step whose sub-groups' new moments never reach the store
    (every update then starts Adam from zero moments) misses the resident run's losses, which
    the equality above would catch."""
    loss, _ = gpt_fit(1, "none", tmp_path)
    first = Store.write_behind

    def first_only(self, name, array):  # (the initial values, then nothing)
        if name not in self.names():
            first(self, name, array)
    monkeypatch.setattr(Store, "write_behind", first_only)
    got, _ = gpt_fit(1, "host", tmp_path)
    assert max(abs(a - b) for a, b in zip(loss, got)) > 1e-3, (loss, got)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    (["--strategy=horovod", "--config.zero.offload=disk"], "zero.offload=disk needs ZeRO"),
    (["--strategy=horovod", "--config.zero.stage=1", "--config.zero.offload=nvme"],
     "'zero.offload' must be none, host or disk"),
    (["--strategy=horovod", "--config.zero.stage=1", "--config.zero.offload=host",
      "--config.tensor.parallel=2"], "zero.offload=host runs on a model that is not split"),
])
def test_bad_offload_configs_are_one_line(tmp_path, flags, needle):
    assert_usage_error(tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
                              "--config.backup.enabled=False", *flags, check=False), needle)


@pytest.mark.horovod
def test_an_unwritable_offload_dir_stops_the_run_in_one_line(tmp_path):
    """`tfdist train` (one Horovod rank, ZeRO-1) with zero.offload_dir under a file: one line,
    exit 2, before any step."""
    (tmp_path / "file").write_text("")
    p = tfdist("train", "--config=configs/gpt_nano.py", f"--workdir={tmp_path / 'run'}",
               "--strategy=horovod", "--config.backup.enabled=False", "--config.zero.stage=1",
               "--config.zero.offload=disk", f"--config.zero.offload_dir={tmp_path / 'file'}",
               check=False)
    assert_usage_error(p, "cannot be written")
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_a_users_offload_without_zero_is_one_line():
    import tfdist.strategies
    with pytest.raises(UsageError, match="needs ZeRO: pass zero=3"):
        tfdist.strategies.get("horovod", offload="disk")


# -- over 2 Horovod ranks, and the training command ----------------------------------------------
def probe(tmp_path, strategy="horovod", stages="1,2,3"):
    from tfdist.strategies.horovod import horovodrun_argv
    program = [sys.executable, os.path.join(ROOT, "tests", "support", "offload_probe.py"),
               f"--strategy={strategy}", f"--dir={tmp_path}", f"--stages={stages}"]
    if strategy == "horovod":
        cmd = horovodrun_argv(2, program)
    else:
        cmd = [sys.executable, "-m", "tfdist", "launch", f"--strategy={strategy}",
               "--workers=2", "--", *program]
    p = run(cmd, timeout=600, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
               if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1], out[-3000:]
    return results


def assert_offload_equals_resident(results, stages):
    for stage in stages:
        for r in results:
            resident = r[f"{stage}-none"]["loss"]
            for kind in ("host", "disk"):
                got = r[f"{stage}-{kind}"]
                assert max(abs(a - b) for a, b in zip(resident, got["loss"])) <= 1e-5, (
                    stage, kind, resident, got["loss"])
                assert got["weights_diff"] <= 1e-5 and got["stored"] > 0, (stage, kind, got)
        for kind in ("none", "host", "disk"):  # both ranks hold the same weights
            assert results[0][f"{stage}-{kind}"]["weights"] == \
                results[1][f"{stage}-{kind}"]["weights"], (stage, kind)


@pytest.mark.slow
@pytest.mark.horovod
def test_zero_1_2_3_offloaded_to_host_and_disk_under_horovod_equal_resident(tmp_path):
    """gpt_nano's shape (2 layers) over 2 ranks, 4 steps: per-step losses within 1e-5 of the same
    stage without offload, the weights within 1e-5, both ranks' bitwise identical."""
    assert_offload_equals_resident(probe(tmp_path), (1, 2, 3))


@pytest.mark.slow
@pytest.mark.long  # (time: the same code as under horovod, with TF's collectives)
def test_offload_under_multi_worker_mirrored_equals_resident(tmp_path):
    assert_offload_equals_resident(probe(tmp_path, "multi_worker_mirrored", "1,3"), (1, 3))


def options(data_dir, **extra):
    return {"data.data_dir": data_dir, "train.steps": 10, "train.steps_per_epoch": 5,
            "train.batch_size": 16, "train.deterministic": True, "backup.every_steps": 1,
            "strategy.name": "horovod", "zero.stage": 3, "zero.offload_subgroup": 20000, **extra}


@pytest.fixture(scope="module")
def resident3(tmp_path_factory, data_dir):
    d = tmp_path_factory.mktemp("offload-resident")
    driver_group(d, options(data_dir), "--hash-weights")
    return d


KILL_IN = "6:1"  # update 6, once sub-group 1's writes have started


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.parametrize("resume", ["disk", pytest.param("none", marks=pytest.mark.long)])
def test_a_run_killed_mid_offloaded_step_resumes_from_its_backup(tmp_path, data_dir, resident3,
                                                                 resume):
    """ZeRO-3 with disk offload over 2 ranks, rank 1 SIGKILLed during the optimizer step of
    update 6 with its store's files half written: the run resumes at step 5 (its newest backup;
    resume=none: into the resident layout) with the resident run's losses within 1e-5 and both
    ranks' weights bitwise identical to each other after every step."""
    p = driver_group(tmp_path, options(data_dir, **{"zero.offload": "disk"}), "--hash-weights",
                     "--kill-in-offload", KILL_IN, "--kill-worker", "1", check=False)
    assert p.returncode != 0
    steps_run = [line for line in open(tmp_path / "executed_steps.txt")]
    # (both ranks ran steps 1-5; rank 0, whose update needs no collective, may end step 6)
    assert 2 * 5 <= len(steps_run) <= 2 * 5 + 1, steps_run
    p = driver_group(tmp_path, options(data_dir, **{"zero.offload": resume}), "--hash-weights")
    assert "at step 5 of 10" in p.stdout, p.stdout[-3000:]
    got, want = losses(tmp_path), losses(resident3)
    assert len(got) == 10 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    hashes = [open(tmp_path / f"weight_hashes-w{r}.txt").read().split() for r in (0, 1)]
    assert hashes[0] == hashes[1]
    if resume == "disk":  # (both ranks' stores, the killed one's too, removed at the end)
        left = list((tmp_path / "offload").iterdir())
        assert not left, left


@pytest.mark.slow
@pytest.mark.horovod
def test_a_disk_that_fills_during_an_offloaded_run_is_one_line(tmp_path, data_dir):
    """The workdir and the offload store on a small file system that fills after step 3: the
    store writes in place, needing no new space; the run's next write (its log, or its backup)
    cannot be: one line, exit 2, and the backup of step 3 intact (a resume after space is freed
    starts there)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (the full filesystem)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tfdist-test-offload",
                    str(disk)], check=True, timeout=30)
    try:
        work = disk / "run"
        settings = options(data_dir, **{"zero.offload": "disk", "train.steps": 6,
                                        "train.steps_per_epoch": 3})
        launch = [sys.executable, "-m", "tfdist", "launch", "--strategy=horovod", "--workers=1",
                  "--max_restarts=0", "--"]
        p = run(launch + driver_argv(work, settings, "--fill-disk-at-step", "3"), timeout=300,
                check=False)
        errors = [x for x in p.stdout.splitlines() if "tfdist: error: " in x]
        assert p.returncode == 2 and len(errors) == 1, p.stdout[-3000:]
        assert "(No space left on device); free space" in errors[0], errors
        assert "(bad usage); not restarting" in p.stdout
        os.remove(work / "filler")
        p = run(launch + driver_argv(work, settings), timeout=300)
        assert "at step 3 of 6" in p.stdout, p.stdout[-3000:]
        assert len(metrics(work)["steps"]) == 6
    finally:
        subprocess.run(["umount", str(disk)], check=True, timeout=30)


@pytest.mark.slow
@pytest.mark.horovod
def test_a_users_keras_hub_gpt2_with_zero3_and_disk_offload_equals_one_device(tmp_path):
    """tfdist.strategies.get("horovod", zero=3, offload="disk"): keras-hub's GPT2CausalLM over 2
    ranks gives one device's losses within 1e-5; its store's files are gone at exit."""
    from tests.test_zero_user import assert_losses_equal, run_program
    single, _ = run_program(tmp_path / "single", "single", "gpt2", extra=["--save_at=0"])
    offload_dir = tmp_path / "offload"
    results, _ = run_program(tmp_path / "hvd", "horovod", "gpt2", extra=[
        "--save_at=0", "--offload=disk", f"--offload_dir={offload_dir}"])
    assert_losses_equal(results, single[0], 2)
    assert not any(os.scandir(offload_dir))


# -- the planner -------------------------------------------------------------------------------
def test_the_planner_chooses_offload_when_nothing_else_fits():
    """GPT-2 XL (float32, 256 tokens) on 2 CPU devices of 12 GiB, the offload rates measured
    here: no resident layout fits (ZeRO-3 over 2 still holds 12.5 GB of state per device), so
    the plans that fit are offloaded ones, disk first (host offload keeps the state in the
    CPU's own memory); without the measured rates none is offered."""
    from tfdist.config import gpt2_config
    from tfdist.plan import model as plan
    c = gpt2_config(n_layer=48, n_head=25, n_embd=1600)
    c.model.block_size, c.model.vocab_size = 256, 50257
    xl = plan.model_from_config(c, "gpt2-xl")
    cpu = plan.Device("cpu", 80e9, 12 * 2**30, None, 0.3e9, 0.3e9, 2, "test")
    rates = dict(disk_read_bw=1.5e9, disk_write_bw=1.8e9, cpu_adam_rate=84e6,
                 cpu_adam_disk_rate=40e6)
    opts = plan.Options(precision="float32", efficiency=0.8, **rates)
    plans = plan.search(xl, plan.Cluster(cpu, 2), 2, opts=opts)
    fitting = [p for p in plans if p.fits]
    assert fitting and all(p.layout.offload == "disk" for p in fitting), [
        (str(p.layout), p.overflow) for p in plans[:6]]
    best = fitting[0]
    read = best.layout.zero == 3 and 2 * xl.params / 2 * 4  # (ZeRO-3: the passes' reads)
    assert plan.offload_io(xl, best.layout, opts)["read"] == pytest.approx(
        xl.params / 2 * (12 if best.layout.zero == 3 else 8) + (read or 0))
    assert "zero.offload" in best.layout.config_overrides()
    bare = plan.search(xl, plan.Cluster(cpu, 2), 2, opts=plan.Options(precision="float32",
                                                                      efficiency=0.8))
    assert not any(p.fits or p.layout.offload != "none" for p in bare)
