"""Data-parallel communication: how the workers' gradients travel (`config.dp`).

The gradient all-reduce of a strategy whose workers reduce them (multi_worker_mirrored, horovod)
is, by default, the strategy's own flat ring in buckets (`tfdist.parallel.buckets`). This package
changes the route, for every layout and both strategies, on top of the sums a strategy gives it
(`collectives.Collectives`, from `Strategy.dp_collectives`):

    hierarchy      auto | flat | host       reduce-scatter in each host, all-reduce across the
                                            hosts, all-gather in each host (`hierarchy`); auto:
                                            where the job has several hosts with several
                                            workers each, and no compression
    compression    none | bf16 | powersgd   the sum over every worker compressed, with error
                   | fp16                   feedback (`compression`); fp16: Horovod's own
    powersgd_rank  1                        PowerSGD's rank r
    powersgd_start 10                       plain sums for the first updates (warm start)
    islands        1                        local-SGD islands, DiLoCo (`islands`; `tfdist
    sync_every     50                       launch --islands=N`): N groups that train on their
    outer_lr, outer_momentum  0.7, 0.9      own and meet every sync_every updates; the outer
    exchange       bf16 | int8 | float32    optimizer; how the deltas travel; how long the
    sync_timeout   120                      others wait for a missing island

The buckets and their overlap with the backward pass are kept: each bucket takes the route on its
own, as soon as its gradients exist.

Example (one worker; `host` needs several hosts of several workers, so `auto` stays flat):

    >>> from tfdist.errors import UsageError
    >>> from tfdist.parallel import dp
    >>> from tfdist.parallel.dp.hosts import Hosts
    >>> settings = dp.Settings(hierarchy="auto")
    >>> settings.route(Hosts(("a", "b", "a", "b"), 0)), settings.route(Hosts(("a", "a"), 0))
    ('host', 'flat')
    >>> try:
    ...     dp.Settings(hierarchy="host").route(Hosts(("a", "b"), 0))
    ... except UsageError as e:
    ...     print(str(e)[:55])
    dp.hierarchy=host needs several hosts with several work
"""
import dataclasses
import itertools

from tfdist import config
from tfdist.errors import UsageError
from tfdist.parallel import buckets
from tfdist.parallel.dp import compression, hierarchy, islands
from tfdist.runtime.lazy import tf

#: The keys of `config.dp` (their defaults and rules: tfdist/config.py).
OPTIONS = tuple(config.default_config().dp.keys())


@dataclasses.dataclass(frozen=True)
class Settings:
    """The data-parallel communication of a run (`config.dp`, or `tfdist.strategies.get`'s
    keywords of the same names)."""
    hierarchy: str = "auto"
    compression: str = "none"
    powersgd_rank: int = 1
    powersgd_start: int = 10
    islands: int = 1
    sync_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    exchange: str = "bf16"
    sync_timeout: float = 120.0

    @classmethod
    def from_config(cls, section):
        return cls(**{k: section[k] for k in OPTIONS if k in section})

    def get_config(self):
        return dataclasses.asdict(self)

    def check(self):
        """UsageError, one line, for the first key with a bad value (config.py's rules), or keys
        that do not go together."""
        for key in OPTIONS:
            config.check_value(f"dp.{key}", getattr(self, key))
        if self.hierarchy == "host" and self.compression != "none":
            raise UsageError(f"dp.hierarchy=host with dp.compression={self.compression}: the "
                             f"compressed sum goes over every worker at once; set "
                             f"dp.hierarchy=auto or flat, or dp.compression=none")
        return self

    def require(self, plugin, zero=0, split=False):
        """UsageError, one line, if strategy plugin class `plugin`, or a layout of ZeRO stage
        `zero` (and `split`: the model laid out over devices) cannot take these settings."""
        if self.hierarchy == "host" and plugin.dp_collectives is None:
            raise UsageError(f"dp.hierarchy=host under strategy {plugin.name}: it routes the "
                             f"gradients of workers that all-reduce them; use "
                             f"multi_worker_mirrored or horovod, or dp.hierarchy=auto")
        ours = self.compression in compression.KINDS[1:]  # (bf16, powersgd: tfdist's own)
        if ours and plugin.dp_collectives is None:
            raise UsageError(f"dp.compression={self.compression} under strategy {plugin.name}: "
                             f"it compresses the all-reduce of workers that sum their "
                             f"gradients; use multi_worker_mirrored or horovod, or "
                             f"dp.compression=none")
        if not ours and self.compression not in ("none", *plugin.own_compression):
            raise UsageError(f"dp.compression={self.compression} is Horovod's own, and the "
                             f"strategy is {plugin.name}: use bf16 or powersgd here (with "
                             f"error feedback), or none")
        if self.islands > 1 and plugin.dp_collectives is None:
            raise UsageError(f"dp.islands={self.islands} under strategy {plugin.name}: an island "
                             f"is a group of synchronous workers; use multi_worker_mirrored or "
                             f"horovod")
        if self.islands > 1 and (zero or split):
            what = f"ZeRO stage {zero}" if zero else "a model split over devices"
            raise UsageError(f"dp.islands={self.islands} with {what}: each island's worker "
                             f"holds the whole model; set dp.islands=1, or train without it")
        if ours and (zero or split):
            what = f"ZeRO stage {zero}" if zero else "a model split over devices"
            raise UsageError(f"dp.compression={self.compression} with {what}: it compresses the "
                             f"plain data-parallel all-reduce of whole gradients; set "
                             f"dp.compression=none, or train without it")

    def route(self, hosts):
        """The gradients' route for workers placed as `hosts` (a `Hosts`): "host" (the
        hierarchical all-reduce), "bf16" or "powersgd" (compressed sums over every worker), or
        "flat" (the strategy's own ring). UsageError where `host` is asked for and the job
        cannot take it."""
        several = len(hosts.names) > 1 and hosts.per_host > 1
        if self.hierarchy == "host" and not several:
            raise UsageError(f"dp.hierarchy=host needs several hosts with several workers each "
                             f"(here {hosts.describe()}); set dp.hierarchy=flat or auto")
        if self.compression in compression.KINDS[1:]:
            return self.compression
        if self.compression != "none":  # (the strategy's own: Horovod's fp16, in its ring)
            return "flat"
        return "host" if several and self.hierarchy != "flat" else "flat"

    def outer(self, local_variables):
        """The islands' `islands.Outer` state of this process (None without islands), made in
        scope `local_variables` (the strategy's). UsageError, one line, if the process was not
        started as an island (`tfdist launch --islands`)."""
        place = islands.check_launch(self.islands)
        return islands.Outer(self, place, local_variables) if self.islands > 1 else None

    def compressor(self, local_variables, worker=0, workers=1):
        """The `compression.Compression` of these settings (None without compression), its
        state made in scope `local_variables` (the strategy's), on `worker` of `workers`."""
        if self.compression not in compression.KINDS[1:]:
            return None
        return compression.Compression(self.compression, self.powersgd_rank,
                                       self.powersgd_start, local_variables, worker, workers)


def reduce(grads_and_vars, c, bucket_bytes=None, log=None, compressor=None):
    """`grads_and_vars` with each gradient reduced over the workers of `c` (`Collectives`),
    bucket by bucket (`tfdist.parallel.buckets`; one bucket when `bucket_bytes` is None), times
    the strategy's scale: along the hierarchical route, or compressed by `compressor` (a
    `compression.Compression`). `log`: the strategy's name, to say how once."""
    count = itertools.count(1)  # the buckets, in order: each collective's name
    grads_and_vars = [(_dense(g, v), v) for g, v in grads_and_vars]
    variable_of = {id(g): v for g, v in grads_and_vars if g is not None}

    def reduce_group(grads):
        name = f"tfdist_dp/bucket{next(count)}_{sum(g.shape.num_elements() for g in grads)}"
        if compressor is not None:
            summed = compressor.sum_tensors(grads, [variable_of[id(g)] for g in grads], c, name)
        else:
            summed = hierarchy.sum_tensors(grads, c, name)
        return [g * c.scale if c.scale != 1.0 else g for g in summed]

    if log and compressor is None:
        buckets.say_once(f"tfdist: {log}: hierarchical all-reduce over {c.hosts.describe()}: "
                         f"reduce-scatter in each host, all-reduce across hosts, all-gather in "
                         f"each host")
    elif log:
        buckets.say_once(f"tfdist: {log}: {compressor.describe()}")
    out = buckets.reduce(grads_and_vars, reduce_group, bucket_bytes, log)
    if compressor is not None:
        with tf.control_dependencies([g for g, _ in out if g is not None]):
            compressor.count()
    return out


def _dense(grad, variable):
    """`grad` as a dense tensor of its variable's static shape (an embedding's `IndexedSlices`,
    and a gradient whose shape TF's graph leaves unknown, such as a sliced position table's)."""
    if grad is None:
        return grad
    return tf.reshape(tf.convert_to_tensor(grad), variable.shape)
