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

from tfdist import config
from tfdist.errors import UsageError, install_excepthook
from tfdist.runtime import cluster
from tfdist.strategies.base import Strategy  # noqa: F401

# a user's program: an uncaught UsageError is one line and exit status 2
install_excepthook(cluster.report_exit)

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


def _register_options():
    """Each plugin's options become keys of `config.strategy` (the config schema knows no plugin;
    the plugins are read without TensorFlow)."""
    for name in names():
        config.register_options("strategy", get_class(name).options, name)


def get_class(name):
    """The plugin class `name` (unknown name: UsageError listing the known ones)."""
    if name not in _PLUGINS:
        raise UsageError(f"unknown strategy '{name}'; choose one of: {', '.join(names())}")
    module, cls = _PLUGINS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def launched_strategy(env=None):
    """The strategy of `get("auto")`: horovod where horovodrun or mpirun started this process,
    else multi_worker_mirrored (TF_CONFIG's workers; one process without it)."""
    env = os.environ if env is None else env
    return "horovod" if any(k in env for k in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK",
                                                "PMI_RANK")) else "multi_worker_mirrored"


def get(name, zero=0, skip_nonfinite=0, offload="none", offload_dir="", auto=False, memory_gb=0.0,
        **options):
    """Builds the plugin `name` with its options (checked against the plugin's rules).
    `zero=3`: a user's model compiled in its scope has its weights sharded over the replicas
    (ZeRO-3, tfdist/parallel/zero/weights.py; horovod, multi_worker_mirrored); with
    `offload="host"` or `"disk"` its master weights and optimizer state are held there
    (tfdist/parallel/zero/offload.py; disk: files under `offload_dir`, default the system's
    temporary directory, removed when the process exits).
    The keys of `config.dp` (`hierarchy`, ...: `tfdist.parallel.dp`) set how the gradients
    travel, under a strategy whose workers reduce them (horovod, multi_worker_mirrored).
    `skip_nonfinite=K`: such a model's updates whose loss or gradients are not finite are
    skipped, and K in a row stop `fit` (tfdist/runtime/nonfinite.py; not parameter_server).
    `name="auto"` (or `auto=True` on horovod or multi_worker_mirrored): a user's model compiled
    in the scope is measured at its first `fit` and trained plainly data parallel, with ZeRO-1, 2
    or 3, or offloaded, its batches in pieces where needed, whichever costs least and fits
    `memory_gb` GiB a process (0: this host's available memory shared by its processes;
    tfdist/parallel/budget.py); "auto" is horovod under horovodrun, else multi_worker_mirrored
    (`launched_strategy`)."""
    if name == "auto":
        name, auto = launched_strategy(), True
        if name == "multi_worker_mirrored" and "cluster" not in options and \
                cluster.from_environment(("chief", "worker")) is None:
            options["cluster"] = cluster.one_local_worker()  # (no launcher: one worker)
    cls = get_class(name)
    from tfdist.parallel import dp
    settings = dp.Settings(**{k: options.pop(k) for k in dp.OPTIONS if k in options}).check()
    settings.require(cls, zero=zero)
    cls.check_options(options)
    if zero and (zero != 3 or not cls.shards_user_models):
        raise UsageError(f"zero={zero!r} under strategy {name}: a user's model is sharded with "
                         f"zero=3 under horovod or multi_worker_mirrored; pass zero=0 here")
    if skip_nonfinite and (not isinstance(skip_nonfinite, int) or skip_nonfinite < 0
                           or not cls.updates_together):
        raise UsageError(f"skip_nonfinite={skip_nonfinite!r} under strategy {name}: give an "
                         f"integer K >= 0 (the skipped updates in a row that stop fit), under a "
                         f"strategy whose replicas update together (not parameter_server)")
    if offload not in ("none", "host", "disk"):
        raise UsageError(f"offload={offload!r}: choose none, host or disk")
    if offload != "none" and not zero:
        raise UsageError(f"offload={offload!r} needs ZeRO: pass zero=3 as well (a user's model "
                         f"offloads its master weights and optimizer state under ZeRO-3, under "
                         f"horovod or multi_worker_mirrored)")
    if auto and not cls.shards_user_models:
        raise UsageError(f"auto=True under strategy {name}: it has nothing to choose for a user's "
                         f"model (ZeRO-3 and offload shard one under horovod or "
                         f"multi_worker_mirrored); use one of those, or \"auto\"")
    if auto and (zero or offload != "none"):
        raise UsageError(f"auto chooses zero and offload itself, and zero={zero!r}, "
                         f"offload={offload!r} were given; pass auto or those, not both")
    if not isinstance(memory_gb, (int, float)) or memory_gb < 0 or (memory_gb and not auto):
        raise UsageError(f"memory_gb={memory_gb!r}: a number of GiB >= 0, the budget of "
                         f"strategy auto (auto=True)")
    plugin = cls(**options, dp=settings)
    plugin.user_auto = memory_gb if auto else None
    plugin.dp = settings
    plugin.user_zero = zero
    plugin.user_offload = None if offload == "none" else (offload, offload_dir)
    plugin.user_skip_nonfinite = skip_nonfinite
    return plugin


def options_of(c):
    """The options of the plugin named by `c.strategy.name` that its section sets (a key the
    section lacks takes the plugin's default)."""
    return {k: c.strategy[k] for k in get_class(c.strategy.name).options if k in c.strategy}


def from_config(c):
    """Builds the plugin named by `c.strategy.name` with its options from that section, and the
    data-parallel communication of `c.dp`."""
    return get(c.strategy.name, **options_of(c), **c.dp.to_dict())


def for_plan(device, processes, per_node, flags):
    """(plugin class, command) the planner recommends for `processes` data-parallel processes
    on devices of kind `device` (see `Strategy.plan_command`), or (None, None)."""
    for name in names():
        cls = get_class(name)
        command = cls.plan_command(device, processes, per_node, flags)
        if command:
            return cls, command
    return None, None


_register_options()
