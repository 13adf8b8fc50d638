"""The Slurm and Kubernetes examples in launchers/: what can be checked without those systems.

* Slurm: the real sbatch script runs, with a stand-in `srun` (tests/support/fake_slurm/srun) that
  starts the job step's tasks on this machine with Slurm's variables. Each task builds its cluster
  from them, through TF's SlurmClusterResolver, and 2 workers train to the end.
* Kubernetes: the TFJob manifest is parsed and checked. Every replica's TF_CONFIG, as the training
  operator writes it, is accepted by tfdist and places the pod. The container's own command runs
  here with its paths moved to a temporary directory.
"""
import glob
import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT, free_port_run, run
from tfdist.launch.local import loopback_shim
from tfdist.runtime import cluster
from tools.cluster.slurm_local import missing as slurm_missing

SBATCH = os.path.join(ROOT, "launchers", "slurm", "tfdist.sbatch")
TFJOB = os.path.join(ROOT, "launchers", "kubernetes", "tfjob.yaml")
TFJOB_PS = os.path.join(ROOT, "launchers", "kubernetes", "tfjob-ps.yaml")


STEPS = 4  # of every training run below


def run_sbatch(tmp_path, data_dir, tasks, **env_extra):
    fake_slurm = os.path.join(ROOT, "tests", "support", "fake_slurm")
    env = {**os.environ, "PATH": fake_slurm + os.pathsep + os.environ["PATH"],
           "SLURM_JOB_ID": "4242", "SLURM_NTASKS": str(tasks), "SLURM_SUBMIT_DIR": ROOT,
           "PYTHON": sys.executable, "TFDIST_SLURM_PORT_BASE": str(free_port_run(tasks)),
           "LD_PRELOAD": loopback_shim(), "TFDIST_BIND": "loopback", "PYTHONUNBUFFERED": "1",
           **env_extra}
    env.pop("TF_CONFIG", None)
    flags = ["--config=configs/gpt_nano.py", f"--workdir={tmp_path}",
             f"--config.train.steps={STEPS}", f"--config.data.data_dir={data_dir}",
             "--config.train.steps_per_epoch=2", "--config.train.warmup_steps=1",
             "--config.train.eval_steps=1"]
    p = subprocess.run(["bash", SBATCH, *flags], env=env, capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"tfdist: prepared {tmp_path}" in p.stdout
    assert f"tfdist: done: {STEPS} steps run (step {STEPS} of {STEPS})" in p.stdout
    assert "tfdist.sbatch: done after 0 restart(s)" in p.stdout
    assert (tmp_path / "model.keras").exists()
    return p.stdout


# Where Debian's Slurm runs here, tests/test_slurm.py runs the same script with 2 tasks under a
# real srun (and asserts the same line): this stand-in run is then a repeat, in make test-long.
@pytest.mark.slow
@(pytest.mark.long if slurm_missing() is None else pytest.mark.slow)
def test_sbatch_script_trains_two_workers_from_slurm_variables(tmp_path, data_dir):
    tasks = 2
    out = run_sbatch(tmp_path, data_dir, tasks)
    assert f"tfdist: multi_worker_mirrored: worker 0 of {tasks}, {tasks} replica(s) in sync" in out


@pytest.mark.slow
@pytest.mark.long  # tfdist launch's parameter-server tests cover its roles
def test_sbatch_parameter_server_variant(tmp_path, data_dir):
    """Task 0 the chief, task 1 the ps, tasks 2-3 workers; the servers end when the chief is
    gone."""
    tasks, ps, orphan_timeout = 4, 1, 2
    out = run_sbatch(tmp_path, data_dir, tasks, STRATEGY="parameter_server", PS=str(ps),
                     TFDIST_SERVER_ORPHAN_TIMEOUT=str(orphan_timeout))
    workers = tasks - 1 - ps  # the rest after the chief and the ps tasks
    assert (f"tfdist: parameter_server: coordinator of {workers} worker(s) and {ps} ps task(s)"
            in out)
    # every server (workers and ps tasks) ends by itself
    assert out.count(f"the chief has been gone for {orphan_timeout} s") == workers + ps


def test_sbatch_script_asks_for_one_task_per_worker():
    text = open(SBATCH).read()
    directives = dict(line[len("#SBATCH --"):].split("=", 1) for line in text.splitlines()
                      if line.startswith("#SBATCH --"))
    assert directives["ntasks-per-node"] == "1" and int(directives["nodes"]) >= 2
    assert "--kill-on-bad-exit=1" in text and "--prepare_only" in text
    assert subprocess.run(["bash", "-n", SBATCH]).returncode == 0  # it parses


def load_tfjob():
    docs = list(yaml.safe_load_all(open(TFJOB)))
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "TFJob"]
    return docs[0], docs[1]


def test_tfjob_manifest_is_a_valid_restartable_multi_worker_job():
    pvc, job = load_tfjob()
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Worker"}  # MultiWorkerMirrored: workers only, worker 0 is the chief
    worker = specs["Worker"]
    assert worker["replicas"] == 2 and worker["restartPolicy"] == "OnFailure"
    assert job["spec"]["runPolicy"]["backoffLimit"] > 0
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "tensorflow"  # required by the training operator
    assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
    cmd = container["command"]
    assert cmd[:2] == ["tfdist", "train"] and "--strategy=multi_worker_mirrored" in cmd
    assert not any(a.startswith("--overwrite") for a in cmd)  # a restarted pod must resume
    (init,) = pod["initContainers"]
    assert init["command"] == cmd + ["--prepare_only"]
    # workdir and data_dir live on the shared volume
    (mount,) = container["volumeMounts"]
    claim = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    assert claim[mount["name"]] == pvc["metadata"]["name"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    for flag in ("--workdir=", "--config.data.data_dir="):
        (value,) = [a[len(flag):] for a in cmd if a.startswith(flag)]
        assert value.startswith(mount["mountPath"] + "/")


def test_tfjob_parameter_server_manifest():
    with open(TFJOB_PS) as f:
        job = yaml.safe_load(f)
    assert job["kind"] == "TFJob" and job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Chief": 1, "Worker": 2, "PS": 1}
    _, collective = load_tfjob()
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow" and spec["restartPolicy"] == "OnFailure"
        assert container["command"][-1] == "--strategy=parameter_server"
        assert not any(a.startswith("--overwrite") for a in container["command"])
        claims = [v["persistentVolumeClaim"]["claimName"]
                  for v in spec["template"]["spec"]["volumes"]]
        assert claims == ["tfdist-runs"]  # the PVC of tfjob.yaml
    name = job["metadata"]["name"]
    cluster_spec = {role: [f"{name}-{role}-{i}.default.svc:2222"
                           for i in range(specs[k]["replicas"])]
                    for k, role in (("Chief", "chief"), ("Worker", "worker"), ("PS", "ps"))}
    for role, addrs in cluster_spec.items():
        for i in range(len(addrs)):
            tf_config = json.dumps({"cluster": cluster_spec, "task": {"type": role, "index": i},
                                    "environment": "cloud"})
            spec = cluster.from_environment(env={"TF_CONFIG": tf_config})
            assert (spec.task_type, spec.task_index, spec.is_chief) == (role, i, role == "chief")


def test_tf_config_of_every_tfjob_replica_places_the_pod():
    _, job = load_tfjob()
    name, n = job["metadata"]["name"], job["spec"]["tfReplicaSpecs"]["Worker"]["replicas"]
    hosts = [f"{name}-worker-{i}.default.svc:2222" for i in range(n)]
    for i in range(n):  # what the operator sets (it adds "environment": "cloud")
        tf_config = json.dumps({"cluster": {"worker": hosts},
                                "task": {"type": "worker", "index": i}, "environment": "cloud"})
        spec = cluster.from_environment(allowed_roles=("chief", "worker"),
                                        env={"TF_CONFIG": tf_config})
        assert (spec.worker_index, spec.num_workers, spec.is_chief) == (i, n, i == 0)


@pytest.mark.slow
def test_tfjob_command_runs_here(tmp_path):
    """The pod's command, with /runs moved to a temporary directory: flags and config are valid."""
    _, job = load_tfjob()
    pod = job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
    cmd = [a.replace("/runs/", f"{tmp_path}/") for a in pod["initContainers"][0]["command"]]
    assert cmd[0] == "tfdist"
    p = run([sys.executable, "-m", "tfdist", *cmd[1:]], timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"tfdist: prepared {tmp_path}/gpt-mini" in p.stdout
    assert any(os.path.exists(os.path.join(d, "manifest.json"))  # the token store, prepared
               for d in glob.glob(str(tmp_path / "tensorflow_datasets" / "tfdist" / "*")))
