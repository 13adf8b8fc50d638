"""`--config.layout=auto` (tfdist/plan/auto.py): the layout chosen for the run's replicas, this
host and a memory budget; said with two runners-up and written to <workdir>/layout.json; the run
then equals the same layout named by hand. Bad input is one line and exit 2."""
import json
import os
import sys

import pytest

from tests.helpers import assert_usage_error, losses, run, tfdist
from tfdist import config
from tfdist.errors import UsageError
from tfdist.plan import auto
from tfdist.strategies import get_class

MACHINE = auto.Machine.assumed(cores=2, ram=16 * 2 ** 30)


def small(**train):
    """A GPT whose model states outweigh its activations (so that ZeRO is what fits)."""
    c = config.default_config()
    c.model.update(n_layer=4, n_head=4, n_embd=256, block_size=32, vocab_size=256)
    c.train.update({"batch_size": 8, "steps": 20, "steps_per_epoch": 10, "warmup_steps": 2,
                    **train})
    return c


def choose(c, strategy="horovod", replicas=2, **kw):
    return auto.choose(c, get_class(strategy), replicas, processes_here=replicas,
                       machine=MACHINE, **kw)


def test_with_room_it_runs_plain_data_parallelism_and_says_why_not_the_others():
    d = choose(small())
    lay = d.chosen.layout
    assert (lay.dp, lay.zero, lay.accumulate, lay.offload) == (2, 0, 1, "none")
    assert len(d.runners_up) == 2
    lines = d.lines()
    assert lines[1].startswith("layout=auto: chose 2 replica(s) (dp=2")
    assert lines[2].startswith("layout=auto: #2 ") and lines[3].startswith("layout=auto: #3 ")
    # the chosen is the fastest of the layouts that fit and run
    assert all(x.seconds >= d.chosen.seconds * (1 - 1e-3) for x in d.considered
               if x.fits and x.refusal is None)


def budget_between(c, a, b):
    """Bytes halfway between two considered layouts' needs (by their str)."""
    every = {str(x.layout): x.bytes for x in choose(c).considered}
    return (every[a] + every[b]) / 2


def test_a_memory_budget_picks_the_fastest_layout_that_fits_in_it():
    c = small()
    plain, zero3 = "dp=2 tp=1 pp=1 mb=4 zero=0", "dp=2 tp=1 pp=1 mb=4 zero=3"
    c.train.memory_gb = budget_between(c, plain, zero3) / 2 ** 30
    d = choose(c)
    assert d.chosen.bytes <= d.budget
    assert d.chosen.layout.zero >= 1  # the plain layout needs more than the budget
    plain_row = next(x for x in d.considered if str(x.layout) == plain)
    assert not plain_row.fits and "needs" in d.why_not(plain_row)
    fitting = [x for x in d.considered if x.fits and x.refusal is None]
    assert d.chosen is min(fitting, key=lambda x: (float(f"{x.tokens_per_sec:.3g}") * -1,
                                                   x.layout.accumulate, x.layout.zero))


def test_without_the_budget_the_same_model_runs_plain():
    """The companion of the test above: the budget is what moved it off plain data parallelism."""
    assert choose(small()).chosen.layout.zero == 0


def test_under_single_it_accumulates_smaller_batches_to_fit():
    c = small(batch_size=16)
    whole, quarter = "dp=1 tp=1 pp=1 mb=16 zero=0", "dp=1 tp=1 pp=1 mb=4 zero=0"
    every = {str(x.layout): x.bytes for x in choose(c, "single", 1).considered}
    c.train.memory_gb = (every[whole] + every[quarter]) / 2 / 2 ** 30
    d = choose(c, "single", 1)
    assert d.chosen.layout.accumulate > 1 and d.chosen.fits
    applied = auto.apply(c, d)
    k = d.chosen.layout.accumulate
    # the same updates on the same tokens: steps counted in batches grow by k
    assert (applied.train.batch_size * k, applied.train.steps, applied.train.grad_accum_steps) \
        == (16, 20 * k, k)
    config.validate(applied)


def test_a_pinned_key_that_cannot_fit_says_what_would():
    c = small()
    c.zero.stage = 1
    plain, zero3 = "dp=2 tp=1 pp=1 mb=1 zero=1", "dp=2 tp=1 pp=1 mb=4 zero=3"
    c.train.memory_gb = budget_between(c, zero3, plain) / 2 ** 30
    with pytest.raises(UsageError, match=r"zero.stage=1 fixed: no layout fits in .* ZeRO-\d "
                                         r"would \(.*\): unset zero.stage"):
        choose(c)


def test_nothing_fits_and_nothing_to_choose_are_one_line():
    c = small()
    c.train.memory_gb = 1e-4
    with pytest.raises(UsageError, match="no layout fits in .* raise train.memory_gb"):
        choose(c)
    with pytest.raises(UsageError, match="parameter_server: it has nothing to choose"):
        choose(small(), "parameter_server")
    one = small(batch_size=1)
    with pytest.raises(UsageError, match="has nothing to choose .it runs one layout"):
        choose(one, "single", 1)


def test_processes_here_from_the_launchers_environment():
    tf_config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2", "10.0.0.2:3"]},
                 "task": {"type": "worker", "index": 1}}
    from tfdist.runtime.cluster import processes_here
    assert processes_here({"TF_CONFIG": json.dumps(tf_config)}) == 2
    assert processes_here({"HOROVOD_LOCAL_SIZE": "3"}) == 3
    assert processes_here({}) == 1


def test_a_bench_dir_of_another_cpu_is_not_used(tmp_path, monkeypatch):
    """Rates measured on another CPU model are said to be another machine's: this CPU's short
    benches are run here instead (tfdist.plan.probe; a stand-in here, the real one below). The
    companion: the same files with this host's CPU are used."""
    import shutil

    from tests.helpers import ROOT
    from tfdist.plan import probe
    from tfdist.runtime.host import this_cpu
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shutil.copytree(os.path.join(ROOT, "bench_results"), tmp_path / "bench_results")
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    scaling = tmp_path / "bench_results" / "scaling.json"
    s = json.loads(scaling.read_text())
    stand_in = probe.Probe(this_cpu()[0], this_cpu()[1], 123e9, 0.5, 1.25, 1.0)

    def measured_as(cpu):
        s["host"] = {**s["host"], "cpu": cpu, "cores": this_cpu()[1]}
        scaling.write_text(json.dumps(s))
        return auto.measure(str(tmp_path / "bench_results"), say=lambda *a, **k: None,
                            probe=lambda cpu, cores, say: stand_in)
    other = measured_as("Another CPU")
    assert (other.peak, other.efficiency, other.contention) == (123e9, 0.5, 1.25)
    assert "another machine type's" in other.source and "probed here" in other.source
    here = measured_as(this_cpu()[0])
    assert here.peak != 123e9 and "of this machine type" in here.source and here.overheads


@pytest.mark.slow
def test_the_short_benches_measure_this_cpu_once_and_a_cache_of_another_is_not_used(
        tmp_path, monkeypatch):
    """The probe's processes run here (a small GPT to keep the test short): their figures are
    cached, and the Machine auto plans with carries the cache file's values and names them; a
    second measure reads the cache (no probe). A cache file at this CPU's path written for
    another CPU model is not used (the probe runs again: a stand-in, the third time)."""
    from tfdist.plan import probe
    from tfdist.runtime.host import this_cpu
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu, cores = this_cpu()
    tiny = dict(n_layer=1, n_head=2, n_embd=64, block_size=32, vocab_size=256)
    runs, lines = [], []

    def small_probe(cpu, cores, say):
        runs.append(cpu)
        return probe.measure(cpu, cores, say, seconds=0.3, batch=2, shape=tiny)
    other_bench = str(tmp_path / "none")  # no scaling.json: another machine type's
    say = lambda line, **k: lines.append(line)  # noqa: E731
    m = auto.measure(other_bench, say=say, probe=small_probe)
    path = probe.cache_path(cpu, cores)
    saved = json.loads(open(path).read())
    assert runs == [cpu] and "measuring its matmul peak and tfdist's step here" in lines[0]
    assert (m.peak, m.efficiency, m.contention) == (saved["peak"], saved["efficiency"],
                                                    saved["contention"])
    assert saved["peak"] > 1e9 and 0.01 < saved["efficiency"] < 2 and saved["contention"] > 0.3
    assert f"matmul {saved['peak'] / 1e9:.0f} GFLOP/s" in m.source and path in m.source
    again = auto.measure(other_bench, say=say, probe=small_probe)
    assert runs == [cpu] and again.peak == m.peak  # read from the cache
    saved["cpu"] = "Another CPU"
    open(path, "w").write(json.dumps(saved))
    stand_in = probe.Probe(cpu, cores, 123e9, 0.5, 1.25, 1.0)
    third = auto.measure(other_bench, say=say, probe=lambda *a: runs.append(cpu) or stand_in)
    assert runs == [cpu, cpu] and third.peak == 123e9  # the other CPU's are not used: measured


# -- tfdist train -----------------------------------------------------------------------------


def nano(data_dir, workdir, *extra):
    return ["--config=configs/gpt_nano.py", f"--workdir={workdir}",
            f"--config.data.data_dir={data_dir}", "--config.train.steps=8",
            "--config.train.steps_per_epoch=4", "--config.train.warmup_steps=2",
            "--config.train.eval_steps=2", "--config.backup.every_steps=4",
            "--config.train.deterministic=True", *extra]


def test_bad_input_is_one_line(tmp_path, data_dir):
    p = tfdist("train", *nano(data_dir, tmp_path / "a", "--config.layout=auto",
                              "--strategy=parameter_server"), check=False)
    assert_usage_error(p, "config.layout=auto under strategy parameter_server: it has nothing "
                          "to choose")
    p = tfdist("train", *nano(data_dir, tmp_path / "b", "--config.layout=auto",
                              "--config.train.memory_gb=0.00001"), check=False)
    assert_usage_error(p, "config.layout=auto: no layout fits in")
    p = tfdist("train", *nano(data_dir, tmp_path / "c", "--config.layout=maybe"), check=False)
    assert_usage_error(p, "layout")


@pytest.mark.slow
@pytest.mark.horovod
def test_auto_under_a_budget_equals_its_layout_named_by_hand(tmp_path, data_dir):
    """Two Horovod ranks under a budget that plain data parallelism exceeds: auto says what it
    chose and why, writes layout.json, and trains the losses of the same layout named by hand."""
    budget = "0.004"  # GiB: gpt_nano's plain layout needs more (see layout.json below)
    launch = [sys.executable, "-m", "tfdist", "launch", "--workers=2", "--strategy=horovod",
              "--"]
    a = run([*launch, *nano(data_dir, tmp_path / "auto", "--config.layout=auto",
                            f"--config.train.memory_gb={budget}")], timeout=400)
    assert "layout=auto: chose" in a.stdout and "layout=auto: #3" in a.stdout, a.stdout[-3000:]
    decision = json.loads((tmp_path / "auto" / "layout.json").read_text())
    chosen = decision["chosen"]
    assert chosen["fits"] and chosen["gib_per_process"] <= float(budget)
    plain = next(r for r in decision["considered"] if r["layout"].endswith("mb=8 zero=0"))
    assert not plain["fits"]
    k = decision["overrides"].get("train.grad_accum_steps", 1)
    named = [f"--config.{key}={value}" for key, value in decision["overrides"].items()]
    named += [f"--config.train.steps={8 * k}", f"--config.train.steps_per_epoch={4 * k}",
              f"--config.train.warmup_steps={2 * k}", f"--config.train.eval_steps={2 * k}",
              f"--config.backup.every_steps={4 * k}"]
    run([*launch, *nano(data_dir, tmp_path / "named"), *named], timeout=400)
    got, want = losses(tmp_path / "auto"), losses(tmp_path / "named")
    assert len(got) == len(want) == 8 * k
    assert max(abs(x - y) for x, y in zip(got, want)) <= 1e-5


@pytest.mark.slow
@pytest.mark.horovod
def test_a_resized_run_plans_again_and_resumes_at_its_backup(tmp_path, data_dir):
    """One Horovod rank under a budget accumulates 2 batches per update; killed after its backup
    of step 4, it is started again on 2 ranks: auto plans for 2 replicas (keeping the 2 batches
    an update its steps count), says so, resumes at step 4 and trains the losses of a run that
    was never stopped."""
    from tests.helpers import DRIVER, losses
    overrides = {"data.data_dir": data_dir, "strategy.name": "horovod", "layout": "auto",
                 "train.memory_gb": 0.007, "train.steps": 8, "train.steps_per_epoch": 4,
                 "train.warmup_steps": 2, "train.eval_steps": 2, "backup.every_steps": 2,
                 "train.deterministic": True}

    def launch(workdir, workers, *extra):
        return run([sys.executable, "-m", "tfdist", "launch", "--strategy=horovod",
                    f"--workers={workers}", "--max_restarts=0", "--", sys.executable, DRIVER,
                    str(workdir), json.dumps(overrides), *extra], timeout=400, check=False)
    whole = launch(tmp_path / "whole", 1)
    assert whole.returncode == 0, whole.stdout[-3000:]
    first = launch(tmp_path / "run", 1, "--kill-at-step", "6", "--kill-worker", "0")
    assert first.returncode != 0
    before = json.loads((tmp_path / "run" / "layout.json").read_text())
    assert before["overrides"]["train.grad_accum_steps"] == 2 and before["replicas"] == 1
    again = launch(tmp_path / "run", 2)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "planned again at this size: the run before ran 1 replica(s), 2 batches" in again.stdout
    assert f"resuming from {tmp_path / 'run'}/backup at step 4 of 16" in again.stdout
    after = json.loads((tmp_path / "run" / "layout.json").read_text())
    assert after["replicas"] == 2 and after["overrides"]["train.grad_accum_steps"] == 2
    got, want = losses(tmp_path / "run"), losses(tmp_path / "whole")
    assert len(got) == len(want) == 16
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
