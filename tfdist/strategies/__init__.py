"""Strategy registry: `get(name, **options)` builds a plugin, `names()` lists them.

Plugins are imported only when asked for, so a strategy's own dependencies (Horovod, a TPU runtime)
are needed only by runs that use it.

A plugin from outside the package is registered with TFDIST_PLUGINS=name=module:Class.

Example:

    >>> import tfdist.strategies
    >>> tfdist.strategies.names()
    ['horovod', 'mirrored', 'multi_worker_mirrored', 'parameter_server', 'single', 'tpu']
    >>> strategy = tfdist.strategies.get("mirrored", devices=2)
    >>> strategy.num_replicas
    2
"""
import importlib
import os

from tfdist.errors import UsageError, install_excepthook
from tfdist.strategies.base import Strategy  # noqa: F401

install_excepthook()  # a user's program: an uncaught UsageError is one line and exit status 2

_PLUGINS = {
    "single": "tfdist.strategies.single:SingleDevice",
    "mirrored": "tfdist.strategies.mirrored:Mirrored",
    "multi_worker_mirrored": "tfdist.strategies.multi_worker:MultiWorkerMirrored",
    "parameter_server": "tfdist.strategies.parameter_server:ParameterServer",
    "horovod": "tfdist.strategies.horovod:Horovod",
    "tpu": "tfdist.strategies.tpu:TPU",
}


def _register_from_environment():
    """TFDIST_PLUGINS="name=module:Class,...": plugins from outside this package (a plugin is one
    file; its module must be importable)."""
    for entry in filter(None, os.environ.get("TFDIST_PLUGINS", "").split(",")):
        name, _, target = entry.partition("=")
        if not name or ":" not in target:
            raise UsageError(f"TFDIST_PLUGINS entry {entry!r} must be name=module:Class")
        _PLUGINS[name.strip()] = target.strip()


_register_from_environment()


def names():
    return sorted(_PLUGINS)


def get_class(name):
    """The plugin class `name` (unknown name: UsageError listing the known ones)."""
    if name not in _PLUGINS:
        raise UsageError(f"unknown strategy '{name}'; choose one of: {', '.join(names())}")
    module, cls = _PLUGINS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get(name, **options):
    """Builds the plugin `name` with its options (checked against the plugin's rules)."""
    cls = get_class(name)
    cls.check_options(options)
    return cls(**options)


def from_config(config):
    """Builds the plugin named by `config.strategy.name` with its options from that section."""
    cls = get_class(config.strategy.name)
    return get(cls.name, **{k: config.strategy[k] for k in cls.options})


def default_options():
    """Every plugin's options with their defaults: the keys of `config.strategy` besides `name`.
    (A key two plugins share must have one default.)"""
    merged = {}
    for name in names():
        for key, (default, _, _) in get_class(name).options.items():
            if merged.setdefault(key, default) != default:
                raise AssertionError(f"strategy option {key}: plugins disagree on its default")
    return merged


def check_config(section):
    """Checks `config.strategy`: the named plugin's options by its rules; the other keys (other
    plugins' options, unused by this run) must be valid for some plugin that declares them."""
    named = get_class(section.name)
    named.check_options(section)
    for key in section:
        if key == "name" or key in named.options:
            continue
        owners = [get_class(n) for n in names() if key in get_class(n).options]
        errors = []
        for cls in owners:
            try:
                cls.check_options({key: section[key]})
                break
            except UsageError as e:
                errors.append(e)
        else:
            if errors:
                raise errors[0]


def for_plan(device, processes, per_node, flags):
    """(plugin class, command) the planner recommends for `processes` data-parallel processes
    on devices of kind `device` (see `Strategy.plan_command`), or (None, None)."""
    for name in names():
        cls = get_class(name)
        command = cls.plan_command(device, processes, per_node, flags)
        if command:
            return cls, command
    return None, None
