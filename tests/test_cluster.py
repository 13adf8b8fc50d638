"""Cluster specs from TF_CONFIG and Slurm: valid ones parse, bad ones are one clear line."""
import inspect
import json
import sys

import pytest

from tests.helpers import assert_usage_error, first_fast, run
from tfdist.errors import UsageError
from tfdist.runtime import cluster

GOOD = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
        "task": {"type": "worker", "index": 1}}


def test_valid_tf_config_parses():
    spec = cluster.from_tf_config(json.dumps(GOOD))
    assert spec.num_workers == 2 and spec.task_index == 1 and not spec.is_chief
    assert spec.worker_index == 1
    chief = cluster.from_tf_config(json.dumps({
        "cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"]},
        "task": {"type": "worker", "index": 0}}))
    assert chief.num_workers == 3 and chief.worker_index == 1 and not chief.is_chief
    assert json.loads(spec.tf_config()) == GOOD
    assert spec.resolver().cluster_spec().as_dict() == GOOD["cluster"]


BAD = {
    "not json": ("{cluster: 1", "not valid JSON"),
    "no cluster": (json.dumps({"task": {"type": "worker", "index": 0}}), 'no "cluster"'),
    "no task": (json.dumps({"cluster": GOOD["cluster"]}), 'no "task"'),
    "task type not in cluster": (json.dumps({**GOOD, "task": {"type": "chief", "index": 0}}),
                                 "not a role"),
    "index out of range": (json.dumps({**GOOD, "task": {"type": "worker", "index": 2}}),
                           "out of range"),
    "negative index": (json.dumps({**GOOD, "task": {"type": "worker", "index": -1}}),
                       "out of range"),
    "duplicate address": (json.dumps({**GOOD, "cluster": {"worker": ["a:1", "a:1"]}}),
                          "given twice"),
    "unknown role for strategy": (json.dumps({**GOOD, "cluster": {**GOOD["cluster"],
                                                                 "ps": ["h:9"]}}), "role 'ps'"),
    "address without port": (json.dumps({**GOOD, "cluster": {"worker": ["a", "b:2"]}}),
                             "not host:port"),
    "empty role": (json.dumps({**GOOD, "cluster": {"worker": []}}), "at least one"),
    "two chiefs": (json.dumps({"cluster": {"chief": ["a:1", "b:1"], "worker": ["c:1"]},
                               "task": {"type": "worker", "index": 0}}), "exactly one chief"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_tf_config_is_one_clear_error(name):
    text, needle = BAD[name]
    with pytest.raises(UsageError, match=needle) as e:
        cluster.from_tf_config(text, allowed_roles=("chief", "worker"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", first_fast(["not json", "index out of range",
                                             "unknown role for strategy"]))
def test_cli_exits_2_with_one_line_for_bad_tf_config(name, tmp_path):
    p = run([sys.executable, "-m", "tfdist", "train", "--strategy=multi_worker_mirrored",
             f"--workdir={tmp_path}"], env={"TF_CONFIG": BAD[name][0]}, check=False, timeout=120)
    assert_usage_error(p, BAD[name][1])
    assert not any(tmp_path.iterdir())


def test_multi_worker_without_a_cluster_says_how_to_get_one(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    from tfdist.strategies.multi_worker import MultiWorkerMirrored
    with pytest.raises(UsageError, match="needs a cluster"):
        MultiWorkerMirrored()


def test_slurm_environment_builds_the_cluster():
    nodes, per_node = 2, 2
    env = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": str(nodes * per_node), "SLURM_PROCID": "3",
           "SLURM_STEP_NODELIST": f"node[1-{nodes}]",
           "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_STEP_NUM_NODES": str(nodes)}
    spec = cluster.from_environment(env=env)
    assert spec.source == "slurm" and spec.num_workers == nodes * per_node and spec.task_index == 3
    base = inspect.signature(cluster.from_slurm).parameters["port_base"].default  # task i: base + i
    assert spec.cluster == {"worker": [f"node{n}:{base + i}" for n in range(1, nodes + 1)
                                       for i in range(per_node)]}
    assert not spec.is_chief and cluster.from_environment(env={**env, "SLURM_PROCID": "0"}).is_chief
