"""Fixtures and pytest hooks only (the helpers the test modules share are in tests/helpers.py).
The default corpus and the single-process reference run are made once per test run, shared by
both pytest processes (helpers.once)."""
import os

import pytest


def pytest_configure(config):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # for every process the tests start
    # The bind shim preloaded, dormant (TFDIST_BIND=all), in every process the tests start: a
    # launch's LD_PRELOAD is then its launcher's, so its agent is a fork of the launcher, which
    # the tests start warm (tfdist.launch.warm.keep_a_fork: ~4 s of CPU a launch). A launch
    # sets TFDIST_BIND for its own processes (its --bind).
    from tfdist.errors import UsageError
    from tfdist.launch.bind import loopback_shim
    try:
        shim = loopback_shim()
    except UsageError:  # (no C compiler: every launch's agent starts fresh, as it would)
        return
    preloaded = os.environ.get("LD_PRELOAD", "").split()
    if shim not in preloaded:
        os.environ["LD_PRELOAD"] = " ".join([shim, *preloaded])
    os.environ.setdefault("TFDIST_BIND", "all")


#: The test files that take longest here (their summed test times in a fresh-clone `make test`,
#: 2026-11-29, most first; those of 15 s and more; test_islands and test_dp, 200-340 s each,
#: added after they had run last and ended the suite alone). `make test` runs 3 pytest
#: processes, each taking the next whole file when it is free (pytest-xdist's loadfile, in the
#: order of collection): the longest first, so that none ends the suite alone on a long one.
SLOWEST_FIRST = ("test_ray", "test_elastic", "test_zero", "test_netcluster", "test_keras_programs",
                 "test_multi_worker", "test_offload", "test_islands", "test_dp",
                 "test_accumulation", "test_backup",
                 "test_horovod", "test_recovery", "test_store", "test_tensor_parallel",
                 "test_spike", "test_launch", "test_mesh", "test_auto_keras", "test_auto",
                 "test_plan", "test_parameter_server",
                 "test_zero_user", "test_horovod_keras_elastic", "test_llama_layouts", "test_data",
                 "test_huggingface", "test_zero3", "test_horovod_keras", "test_slurm",
                 "test_pipeline", "test_strategies", "test_nonfinite", "test_plugins", "test_cli",
                 "test_cli_help", "test_doctests", "test_harness", "test_llama", "test_layers")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = os.path.splitext(os.path.basename(str(item.fspath)))[0]
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)
    items.sort(key=rank)  # stable: each file's tests keep their order
    from tfdist.runtime import cpu
    blocked = cpu.bf16_blocked()
    for item in items:  # a second CPU type by oneDNN's cap (docs/testing.md): bfloat16 aside
        if blocked and "bf16" in item.keywords:
            item.add_marker(pytest.mark.skip(
                reason=f"{blocked}: an artefact of the cap (a real CPU without AVX-512 runs "
                       f"bfloat16 on TF's Eigen kernels; tfdist train refuses it here in one "
                       f"line, tests/test_cli.py)"))


def _run_root(tmp_path_factory):
    """The directory both pytest processes of one test run share (pytest-xdist gives each its own
    base directory inside it); the base directory itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data_dir with the default corpus (this Python's stdlib) prepared in it as a token store:
    once per test run (helpers.once), read by both pytest processes."""
    from tests.helpers import once

    def prepare(d):
        from tfdist import config
        from tfdist.data import open_store
        c = config.default_config()
        c.data.data_dir = str(d)
        open_store(c.data, progress=False)
    return str(once(_run_root(tmp_path_factory), "tfds", prepare))


@pytest.fixture(scope="session")
def single_reference(tmp_path_factory, data_dir):
    """The run of helpers.single_overrides (its weights dumped: `weights(d, 0)`), made once per
    test run; its DRIVER_RESULT is in result.json."""
    import json

    from tests.helpers import driver, once, single_overrides

    def make(d):
        _, result = driver(d, single_overrides(data_dir), "--dump-weights")
        (d / "result.json").write_text(json.dumps(result))
    return once(_run_root(tmp_path_factory), "single-reference", make)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_on_the_network():
    """After the suite (each pytest process's part of it): no network namespace of a test
    cluster it made is left (tools/cluster/netcluster.py names them after the process that made
    them), and the machine's own interfaces are those it had before (tests/test_netcluster.py
    shows the check failing on a cluster left up)."""
    import shutil
    if shutil.which("ip") is None or os.geteuid() != 0:
        yield
        return
    from tools.cluster.netcluster import leftovers, root_links
    before = root_links()
    yield
    left = leftovers(f"tfdist{os.getpid() % 100000}-", before)
    assert not left, f"the tests left this on the machine's network: {left}"


@pytest.fixture(scope="session", autouse=True)
def no_process_left():
    """After the suite (each pytest process's part of it): no process that one of its commands
    started is alive (each carries its command's mark, tools/faults/harness.py `MARK`; its
    command's end kills what it left, `end_marked`). What is found is killed, and the suite fails
    (tests/test_harness.py shows a timed-out launcher's processes found and ended)."""
    from tools.faults import harness
    yield
    left = harness.end_marked(prefix=f"{os.getpid()}-")
    assert not left, f"the tests left these processes running (killed now): {left}"
