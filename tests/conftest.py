"""Fixtures and pytest hooks only (the helpers the test modules share are in tests/helpers.py).
TF and the default corpus are prepared once per session in a private data_dir."""
import os

import pytest



def pytest_configure(config):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # for every process the tests start


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
