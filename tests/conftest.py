"""Fixtures and pytest hooks only (the helpers the test modules share are in tests/helpers.py).
TF and the default corpus are prepared once per session in a private data_dir."""
import os

import pytest



def pytest_configure(config):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # for every process the tests start


#: The test files that take longest here (`make test` on 2026-11-26, most first). `make test` runs
#: 2 pytest processes, each taking the next whole file when it is free (pytest-xdist's loadfile, in
#: the order of collection): the longest first, so that neither ends the suite alone on a long one.
SLOWEST_FIRST = ("test_zero", "test_parameter_server", "test_netcluster", "test_multi_worker",
                 "test_horovod", "test_tensor_parallel", "test_store", "test_keras_programs",
                 "test_backup", "test_plan", "test_slurm", "test_horovod_keras")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = os.path.splitext(os.path.basename(str(item.fspath)))[0]
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)
    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data_dir with the default corpus (this Python's stdlib) prepared in it as a token store."""
    d = str(tmp_path_factory.mktemp("tfds"))
    from tfdist import config
    from tfdist.data import open_store

    c = config.default_config()
    c.data.data_dir = d
    open_store(c.data, progress=False)
    return d


@pytest.fixture(scope="session", autouse=True)
def nothing_left_on_the_network():
    """After the suite (each pytest process's part of it): no network namespace of a test
    cluster it made is left (tools/netcluster.py names them after the process that made them),
    and the machine's own interfaces are those it had before (tests/test_netcluster.py shows the
    check failing on a cluster left up)."""
    import shutil
    if shutil.which("ip") is None or os.geteuid() != 0:
        yield
        return
    from tools.netcluster import leftovers, root_links
    before = root_links()
    yield
    left = leftovers(f"tfdist{os.getpid() % 100000}-", before)
    assert not left, f"the tests left this on the machine's network: {left}"
