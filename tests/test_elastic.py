"""Elastic `tfdist launch` (tfdist/launch/elastic.py): a host lost for good, the job going on on
the rest; a host offered, the job growing back; the global batch the same at every size.

The trials across hosts use tools/cluster/netcluster.py's network namespaces (root; skipped with the
reason otherwise) and tools/faults/chaos_elastic.py's trial, which `make chaos-elastic` runs 5 times
per strategy.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, tfdist, wait_until
from tfdist.launch.elastic import Membership, parse_hosts
from tools.cluster.netcluster import NetCluster, missing
from tools.faults import chaos_elastic
from tools.faults.chaos_elastic import BATCH, elastic_trial, rows, train_flags, verdict


# -- which hosts are there -------------------------------------------------------------------------
def test_discovery_output_is_host_or_host_slots():
    assert parse_hosts("a:2\n\n10.0.0.3\n") == [("a", 2), ("10.0.0.3", 1)]
    for bad in ("a:0", "a:x", "a b", "host:2:3", "<html>"):
        with pytest.raises(ValueError, match="is not host or host:slots"):
            parse_hosts(bad)


def test_a_failing_or_garbled_discovery_is_one_line_and_keeps_the_hosts(tmp_path):
    hosts, said = tmp_path / "hosts", []
    hosts.write_text("127.0.0.1:2\n")
    m = Membership(discovery=f"cat {hosts}", max_workers=3, port=12345, say=said.append)
    assert m.offer() == ["127.0.0.1", "127.0.0.1"] and said == []
    hosts.write_text("127.0.0.1:2\nSegmentation fault (core dumped)\n")
    assert m.offer() == ["127.0.0.1", "127.0.0.1"]
    assert said == [f"--discovery='cat {hosts}' failed: 'Segmentation fault (core dumped)' is not "
                    f"host or host:slots; keeping the hosts it printed last (127.0.0.1:2)"]
    assert m.offer() == ["127.0.0.1", "127.0.0.1"] and len(said) == 1  # said once, not each time
    os.remove(hosts)
    assert m.offer() == ["127.0.0.1", "127.0.0.1"] and len(said) == 2
    assert "failed: exited with status 1 (cat: " in said[1] and said[1].endswith("(127.0.0.1:2)")
    hosts.write_text("127.0.0.1:5\nno-such-host.invalid\n")
    assert (m.offer() == ["127.0.0.1", "127.0.0.1"]
            and "cannot resolve host 'no-such-host." in said[2])
    hosts.write_text("127.0.0.1:5\n")
    assert m.offer() == ["127.0.0.1"] * 3  # at most --max_workers


@pytest.mark.skipif(missing() is not None, reason=str(missing()))
def test_a_host_is_there_while_it_answers():
    """From host 0: host 1 answers (nothing listens on the port: refused, which is an answer);
    cut off, it does not (no answer within the probe's 1 s); healed, it is there again."""
    probe = ("import sys; from tfdist.launch.elastic import Membership; "
             "print(Membership(hosts=sys.argv[1:], max_workers=4, port=9).offer())")
    with NetCluster(2) as net:
        def offer():
            p = net.run(0, [sys.executable, "-c", probe, net.address(0), net.address(1)], cwd=ROOT)
            assert p.returncode == 0, p.stderr
            return p.stdout.strip()
        both = str([net.address(0), net.address(1)] * 2)
        assert offer() == both
        net.partition(1)
        assert offer() == str([net.address(0)] * 2)
        net.heal(1)
        assert offer() == both


# -- bad input: one line, exit 2 -------------------------------------------------------------------
def _launch(*flags, rest=("--config=configs/gpt_nano.py",), timeout=120):
    return subprocess.run([sys.executable, "-m", "tfdist", "launch", *flags, "--", *rest], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, line", [
    (["--workers=2", "--min_workers=3"],
     "tfdist: error: --min_workers (3) is above --workers (2): the job starts with --workers and "
     "shrinks down to --min_workers"),
    (["--workers=3", "--max_workers=2", "--min_workers=1"],
     "tfdist: error: need 1 <= --min_workers <= --workers <= --max_workers <= 64, got 1 <= 3 <= 2"),
    (["--strategy=parameter_server", "--workers=2", "--min_workers=1"],
     "tfdist: error: strategy parameter_server does not resize (--min_workers, --max_workers, "
     "--discovery): it already trains on with the workers it has (a lost worker's steps run on "
     "the others; it is restarted alone)"),
    (["--workers=2", "--min_workers=1", "--discovery= "],
     "tfdist: error: --discovery is empty: give a command printing host:slots lines"),
])
def test_an_elastic_range_that_cannot_run_is_one_line(flags, line):
    p = _launch(*flags)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[-1] == line, p.stderr
    assert "Traceback" not in p.stderr and "started" not in p.stdout


@pytest.mark.parametrize("flags, config, line", [
    (["--max_workers=3"], "--config.train.batch_size=16",
     "tfdist: error: an elastic job may run on 3 worker(s) (--min_workers=1 .. --max_workers=3): "
     "train.batch_size (16) must be divisible by the 3 replicas of strategy multi_worker_mirrored"),
    pytest.param(["--strategy=horovod"], "--config.strategy.lr_scaling=linear",
                 "tfdist: error: strategy.lr_scaling=linear scales the learning rate by the number "
                 "of workers, which an elastic job changes; set it to none (the global batch, and "
                 "so the rate, stay the same)", marks=[pytest.mark.slow, pytest.mark.horovod]),
])
def test_a_config_some_allowed_size_cannot_run_is_one_line(tmp_path, data_dir, flags, config,
                                                           line):
    """Checked once, before any worker starts: a batch that 3 workers cannot split, and a
    learning rate scaled by the number of workers."""
    p = _launch("--workers=2", "--min_workers=1", *flags,
                rest=["--config=configs/gpt_nano.py", f"--workdir={tmp_path / 'run'}",
                      f"--config.data.data_dir={data_dir}", config])
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[-1] == line, p.stderr
    assert "Traceback" not in p.stderr and not os.path.exists(tmp_path / "run" / "backup")


# -- across hosts: shrink, then grow ---------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """The trials' run never interrupted, in one process at the same global batch: the losses
    every resized run must match (those of the 2-worker run on loopback within 5e-7 here, the
    trials' tolerance 1e-5; one process costs a third of its CPU)."""
    work = tmp_path_factory.mktemp("elastic-reference")
    tfdist("train", *train_flags(work, data_dir), timeout=600)
    return [r["loss"] for r in rows(work)]


@pytest.mark.slow
@pytest.mark.skipif(missing() is not None, reason=str(missing()))
@pytest.mark.parametrize("strategy", [
    # (long: the suite's time; the elastic launcher is the same for both, and MWMS's own lost
    # node is the Slurm trial's below)
    pytest.param("multi_worker_mirrored", marks=pytest.mark.long),
    pytest.param("horovod", marks=pytest.mark.horovod)])
def test_a_lost_host_is_dropped_and_a_new_one_joins(tmp_path, data_dir, reference, strategy):
    """3 hosts; the job starts on hosts 0 and 1. At step 14 every process on host 1 is SIGKILLed
    and its link cut for good (it stays in the discovery output): within 60 s the job trains on
    host 0 alone, from host 0's memory of the newest step it completed. At step 50 host 2 is
    offered: it joins within 60 s. The run ends at step 200 with every step logged once, each
    with the global batch of 16, and every loss equal to the uninterrupted run's within
    1e-5."""
    with NetCluster(3, rate="1gbit") as net:
        r = elastic_trial(net, tmp_path / "run", data_dir, strategy, at_step=14)
    checks, diff = verdict(r, reference)
    out = r["output"]
    assert all(checks.values()), (checks, diff, r["continued_s"], out[-5000:])
    assert f"{net.address(1)} not back within 10 s: dropped; going on with 1 worker(s)" in out
    assert "grow from 1 to 2 worker(s)" in out
    k = out.find("Traceback")
    assert k < 0, out[max(0, k - 500):k + 4000]
    sizes = [x["replicas"] for x in r["rows"]]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, sizes
    # from memory: the step host 0 completed, at least the one the log held at the kill
    assert r["resumed_at"][0] >= r["cut_at"] and "resuming from memory:" in out
    assert {x["global_batch"] for x in r["rows"]} == {BATCH}


@pytest.mark.slow
@pytest.mark.long  # the companion of the trial above: what the same fault does without elasticity
@pytest.mark.skipif(missing() is not None, reason=str(missing()))
def test_without_elasticity_a_host_lost_for_good_ends_the_job(tmp_path, data_dir):
    """The same fault under a fixed `tfdist launch --hosts`: the restarted group waits for host 1
    (TFDIST_JOIN_TIMEOUT, here 20 s), restarts again, and gives up (exit 1): the trial's checks
    fail without the elastic launcher."""
    work = tmp_path / "run"
    with NetCluster(2, rate="1gbit") as net:
        env = {**os.environ, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"],
               "TFDIST_JOIN_TIMEOUT": "20"}
        p = net.popen(0, [sys.executable, "-m", "tfdist", "launch",
                          f"--hosts={net.address(0)},{net.address(1)}", "--workers=2",
                          "--max_restarts=1", "--backoff=1", "--", *train_flags(work, data_dir)],
                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
        wait_until(lambda: len(rows(work)) >= 14, 300, "step 14", proc=p)
        net.kill(1)
        net.partition(1)
        out, _ = p.communicate(timeout=600)
    assert p.returncode == 1, out[-3000:]
    assert "gave up after 1 restart(s)" in out
    assert len(rows(work)) < chaos_elastic.STEPS


# -- Slurm: a job whose node is lost ---------------------------------------------------------------
def _slurm_missing():
    from tools.cluster.slurm_local import missing as slurm_missing
    return missing() or slurm_missing()


def _slurm_node_lost(tmp_path, data_dir, sbatch=()):
    """tfdist-elastic.sbatch on a 2-node Slurm (with `sbatch` flags); node h1 dies at step 14.
    (Without `--no-kill` the job completes too here: slurmctld had not yet marked the node down,
    only not responding, when the job ended, 35 s after the kill.)"""
    from tools.cluster.slurm_local import LocalSlurm
    work, out = tmp_path / "run", tmp_path / "job.out"
    script = os.path.join(ROOT, "launchers", "slurm", "tfdist-elastic.sbatch")
    with NetCluster(2, rate="1gbit") as net, LocalSlurm(cpus=2, net=net) as slurm:
        env = {**os.environ, **slurm.env, "PATH": net.ssh_path() + os.pathsep + os.environ["PATH"],
               "TFDIST_DIR": ROOT, "PYTHON": sys.executable, "REJOIN_TIMEOUT": "10",
               "PYTHONUNBUFFERED": "1"}
        env.pop("TF_CONFIG", None)
        p = net.popen(0, ["sbatch", "--wait", "--nodelist=h0,h1", f"--output={out}", *sbatch,
                          script, *train_flags(work, data_dir)], env=env, cwd=ROOT,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_until(lambda: len(rows(work)) >= 14, 300, "step 14", proc=p)
        net.kill(1)  # node h1 dies: its slurmd, and the worker running there
        net.partition(1)
        killed = time.monotonic()
        continued = None
        if wait_for(lambda: any(r["replicas"] == 1 for r in rows(work)), 120, p):
            continued = time.monotonic() - killed

        def job():  # the job's state, as slurmctld has it (the only job of this Slurm)
            show = net.run(0, ["scontrol", "-o", "show", "job"], env=env).stdout
            return (re.findall(r"JobState=(\S+)", show) or ["?"])[0]
        ended = wait_for(lambda: job() not in ("PENDING", "RUNNING"), 600, p)
        state = net.run(0, ["sinfo", "-h", "-N", "-n", "h1", "-o", "%T"], env=env).stdout.strip()
        final = job()
        try:  # (once, sbatch --wait saw the ended job later than 30 s: the job's state counts)
            p.wait(timeout=70)
        except subprocess.TimeoutExpired:  # sbatch --wait, on a node that never answers again
            p.kill()
            p.wait()
    status = p.returncode if p.returncode >= 0 else (0 if final == "COMPLETED" else final)
    return {"exit": status, "ended": ended,
            "state": state, "continued": continued, "work": work,
            "text": out.read_text() if out.exists() else ""}


def wait_for(condition, timeout, proc):
    """Whether `condition()` became true within `timeout` s, while `proc` ran."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
@pytest.mark.skipif(_slurm_missing() is not None, reason=str(_slurm_missing()))
def test_a_slurm_job_whose_node_is_lost_goes_on_on_the_other(tmp_path, data_dir, reference):
    """A real Slurm of 2 nodes (tools/cluster/slurm_local.py, each node a network namespace with
    its own slurmd). launchers/slurm/tfdist-elastic.sbatch (`--no-kill`) runs the elastic launcher
    on node h0, one worker per node. At step 14 node h1 dies: its slurmd and its worker SIGKILLed,
    its link cut for good. Slurm sees it not responding; the job trains on h0 alone within 60 s
    and completes (exit 0), every step once, the losses the uninterrupted run's within 1e-5."""
    r = _slurm_node_lost(tmp_path, data_dir)
    text, state, continued, work = r["text"], r["state"], r["continued"], r["work"]
    assert r["ended"] and r["exit"] == 0, text[-5000:]
    # Slurm saw the node lost ("*": not responding; "down" after SlurmdTimeout), and kept the job
    assert state.startswith("down") or state.endswith("*"), state
    assert continued is not None and continued <= chaos_elastic.CONTINUE_BOUND, continued
    assert "not back within 10 s: dropped; going on with 1 worker(s)" in text
    logged = rows(work)
    assert [x["step"] for x in logged] == list(range(1, chaos_elastic.STEPS + 1))
    assert logged[0]["replicas"] == 2 and logged[-1]["replicas"] == 1
    assert {x["global_batch"] for x in logged} == {BATCH}
    assert max(abs(a["loss"] - b) for a, b in zip(logged, reference)) <= chaos_elastic.TOLERANCE
