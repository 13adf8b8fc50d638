"""launchers/slurm/tfdist.sbatch through a real Slurm: Debian's slurm-wlm as one node with 2 CPUs
(tools/cluster/slurm_local.py), the real `sbatch` and `srun`, 2 MultiWorkerMirrored tasks.

* A task SIGKILLed mid-run: the script reruns the step and it resumes at the backed-up step; every
  step is in metrics.json exactly once.
* The end window: a workdir as a kill after the final backup and before `model.keras` leaves it
  (the backup at the last step, no model): the job finishes it, exit 0, the same model.
* Slurm's warning signal: USR1 to the batch script of a `--requeue` job; both tasks back up one
  step, the job requeues itself and resumes there.

Skipped, with the reason, where Slurm cannot run (not root; slurm-wlm or munge missing:
`make cluster-tools` installs them). The stand-in `srun` of test_cluster_launchers.py stays for
the parameter-server variant (4 tasks on this 2-CPU node) and for machines without Slurm.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, final_weights, free_port_run, wait_until
from tools.cluster.slurm_local import LocalSlurm, missing

pytestmark = [pytest.mark.skipif(missing() is not None, reason=str(missing())),
              pytest.mark.slow]
SBATCH = os.path.join(ROOT, "launchers", "slurm", "tfdist.sbatch")
STEPS = 20
KILL_AFTER = 6  # a task is killed once the backup has reached this step


@pytest.fixture(scope="module")
def slurm():
    with LocalSlurm(cpus=2) as s:
        yield s


def submit(slurm, workdir, data_dir, *sbatch_flags):
    """`sbatch --wait` of the script (a Popen) and its output file."""
    out = os.path.join(workdir, "job.out")
    flags = ["--config=configs/gpt_nano.py", f"--workdir={workdir}",
             f"--config.data.data_dir={data_dir}", f"--config.train.steps={STEPS}",
             "--config.train.steps_per_epoch=10", "--config.train.eval_steps=2",
             "--config.train.deterministic=True", "--config.backup.every_steps=1",
             "--config.backup.delete_on_success=False"]
    env = {**os.environ, **slurm.env, "TFDIST_DIR": ROOT, "PYTHON": sys.executable,
           "BACKOFF": "1", "MAX_RESTARTS": "2", "TFDIST_SLURM_PORT_BASE": str(free_port_run(2)),
           "PYTHONUNBUFFERED": "1"}  # no bind shim: srun must listen where slurmstepd dials
    env.pop("TF_CONFIG", None)
    os.makedirs(workdir, exist_ok=True)
    p = subprocess.Popen(["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2",
                          "--cpus-per-task=1", f"--output={out}", *sbatch_flags, SBATCH, *flags],
                         env=env,
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, out


def job_id(p):
    line = p.stdout.readline()  # "Submitted batch job N", printed before --wait waits
    assert line.startswith("Submitted batch job"), line + p.stderr.read()
    return line.split()[-1]


def task_pid(job, rank):
    """The PID of task `rank` of job `job` (its tfdist process: ours, found by its environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if (env.get(b"SLURM_JOB_ID") == job.encode()
                and env.get(b"SLURM_PROCID") == str(rank).encode()
                and b"tfdist\0train" in cmd and b"--prepare_only" not in cmd):
            return int(pid)
    return None


def backed_up_step(workdir):
    try:
        with open(os.path.join(workdir, "backup", "checkpoint")) as f:
            return int(f.readline().split('"')[1].rsplit("-", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0


def finish(p, out, timeout=600):
    try:
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()  # sbatch --wait only; the job itself ends at the daemons' shutdown
            p.wait()
    with open(out) as f:
        return f.read()


@pytest.fixture(scope="module")
def killed_and_resumed(slurm, tmp_path_factory, data_dir):
    work = str(tmp_path_factory.mktemp("slurm-run"))
    p, out = submit(slurm, work, data_dir)
    job = job_id(p)
    wait_until(lambda: backed_up_step(work) >= KILL_AFTER, 400, "the backup to reach step 6",
               proc=p)
    pid = task_pid(job, 1)
    assert pid, "task 1 of the job was not found"
    os.kill(pid, signal.SIGKILL)
    text = finish(p, out)
    assert p.returncode == 0, text[-4000:]
    return work, text


def test_a_killed_task_is_rerun_and_resumes_at_the_backed_up_step(killed_and_resumed):
    work, text = killed_and_resumed
    assert "tfdist: multi_worker_mirrored: worker 0 of 2, 2 replica(s) in sync" in text
    assert "tfdist.sbatch: step failed (status" in text and "restart 1 of 2" in text
    resumed = [line for line in text.splitlines() if "tfdist: resuming from" in line]
    assert len(resumed) == 1 and f"{work}/backup at step " in resumed[0], text[-3000:]
    at = int(resumed[0].split(" at step ")[1].split()[0])
    assert KILL_AFTER <= at < STEPS
    with open(os.path.join(work, "metrics.json")) as f:
        steps = [r["step"] for r in json.load(f)["steps"]]
    assert steps == list(range(1, STEPS + 1))  # each step once: none lost, none twice
    assert f"tfdist: done: {STEPS - at} steps run (step {STEPS} of {STEPS})" in text
    assert "tfdist.sbatch: done after 1 restart(s)" in text


# time: tests/test_backup.py shows the end window; the SIGKILL case the script's rerun
@pytest.mark.long
def test_the_end_window_finishes_under_slurm(slurm, killed_and_resumed, tmp_path, data_dir):
    """What a kill after the final backup and before model.keras leaves: the job finishes it."""
    done, _ = killed_and_resumed
    work = str(tmp_path / "run")
    shutil.copytree(done, work)
    os.remove(os.path.join(work, "model.keras"))  # as if killed before it was written
    os.remove(os.path.join(work, "job.out"))
    assert backed_up_step(work) == STEPS
    p, out = submit(slurm, work, data_dir)
    job_id(p)
    text = finish(p, out)
    assert p.returncode == 0, text[-4000:]
    assert f"is at the final step {STEPS}; training is done" in text
    assert "tfdist.sbatch: done after 0 restart(s)" in text
    for a, b in zip(final_weights(work), final_weights(done)):
        assert (a == b).all()


@pytest.mark.long  # time (about 2 min); the SIGKILL and end-window cases are in make test
def test_usr1_backs_up_requeues_and_the_job_resumes_at_that_step(slurm, killed_and_resumed,
                                                                 tmp_path, data_dir):
    """Slurm's warning signal (`sbatch --signal=B:USR1@<s>`, sent here at once with `scancel
    --signal=USR1 --batch`): the script passes USR1 on to the step, both tasks back up the same
    step and exit 75, the script requeues the job (`scontrol requeue`), and the job's next run
    resumes at that step and finishes with the weights of the uninterrupted-by-signal run."""
    done, _ = killed_and_resumed
    work = str(tmp_path / "run")
    p, out = submit(slurm, work, data_dir, "--requeue", "--open-mode=append")
    job = job_id(p)
    wait_until(lambda: backed_up_step(work) >= KILL_AFTER, 400, "the backup to reach step 6",
               proc=p)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env={**os.environ, **slurm.env},
                   check=True, timeout=30)
    text = finish(p, out)
    assert p.returncode == 0, text[-4000:]
    assert f"job {job} requeued" in text, text[-4000:]
    at = int(re.findall(r"preempted \(\w+\) at step (\d+): backup written", text)[0])
    assert f"resuming from {work}/backup at step {at} of {STEPS}" in text, text[-4000:]
    with open(os.path.join(work, "metrics.json")) as f:
        assert [r["step"] for r in json.load(f)["steps"]] == list(range(1, STEPS + 1))
    for a, b in zip(final_weights(work), final_weights(done)):
        assert (a == b).all()
