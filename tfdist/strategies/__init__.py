"""Strategy registry: `get(name, **options)` builds a plugin, `names()` lists them.

Plugins are imported only when asked for, so a strategy's own dependencies (Horovod, a TPU runtime)
are needed only by runs that use it.

Example:

    import tfdist.strategies
    print(tfdist.strategies.names())            # ['mirrored', 'single']
    strategy = tfdist.strategies.get("mirrored", devices=2)
"""
import importlib

from tfdist.errors import UsageError
from tfdist.strategies.base import Strategy  # noqa: F401

_PLUGINS = {
    "single": "tfdist.strategies.single:SingleDevice",
    "mirrored": "tfdist.strategies.mirrored:Mirrored",
    "multi_worker_mirrored": "tfdist.strategies.multi_worker:MultiWorkerMirrored",
    "parameter_server": "tfdist.strategies.parameter_server:ParameterServer",
    "horovod": "tfdist.strategies.horovod:Horovod",
    "tpu": "tfdist.strategies.tpu:TPU",
}


def names():
    return sorted(_PLUGINS)


def get_class(name):
    """The plugin class `name` (unknown name: UsageError listing the known ones)."""
    if name not in _PLUGINS:
        raise UsageError(f"unknown strategy '{name}'; choose one of: {', '.join(names())}")
    module, cls = _PLUGINS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get(name, **options):
    """Builds the plugin `name` with its options."""
    return get_class(name)(**options)


def from_config(config):
    """Builds the plugin named by `config.strategy.name` with the options of that section."""
    options = config.strategy.to_dict()
    return get(options.pop("name"), **options)
