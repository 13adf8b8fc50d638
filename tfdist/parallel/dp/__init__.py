"""Data-parallel communication: how the workers' gradients travel (`config.dp`).

The gradient all-reduce of a strategy whose workers reduce them (multi_worker_mirrored, horovod)
is, by default, the strategy's own flat ring in buckets (`tfdist.parallel.buckets`). This package
changes the route, for every layout and both strategies, on top of the sums a strategy gives it
(`collectives.Collectives`, from `Strategy.dp_collectives`):

    hierarchy  auto | flat | host    reduce-scatter in each host, all-reduce across the hosts,
                                     all-gather in each host (`hierarchy`); auto: where the job
                                     has several hosts with several workers each

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
from tfdist.parallel.dp import hierarchy
from tfdist.runtime.lazy import tf

#: The keys of `config.dp` (their defaults and rules: tfdist/config.py).
OPTIONS = tuple(config.default_config().dp.keys())


@dataclasses.dataclass(frozen=True)
class Settings:
    """The data-parallel communication of a run (`config.dp`, or `tfdist.strategies.get`'s
    keywords of the same names)."""
    hierarchy: str = "auto"

    @classmethod
    def from_config(cls, section):
        return cls(**{k: section[k] for k in OPTIONS if k in section})

    def get_config(self):
        return dataclasses.asdict(self)

    def check(self):
        """UsageError, one line, for the first key with a bad value (config.py's rules)."""
        for key in OPTIONS:
            config.check_value(f"dp.{key}", getattr(self, key))
        return self

    def require(self, plugin):
        """UsageError, one line, if strategy plugin class `plugin` cannot take these settings."""
        if self.hierarchy == "host" and plugin.dp_collectives is None:
            raise UsageError(f"dp.hierarchy=host under strategy {plugin.name}: it routes the "
                             f"gradients of workers that all-reduce them; use "
                             f"multi_worker_mirrored or horovod, or dp.hierarchy=auto")

    def route(self, hosts):
        """"host" (the hierarchical all-reduce) or "flat" for workers placed as `hosts` (a
        `Hosts`). UsageError where `host` is asked for and the job cannot take it."""
        several = len(hosts.names) > 1 and hosts.per_host > 1
        if self.hierarchy == "host" and not several:
            raise UsageError(f"dp.hierarchy=host needs several hosts with several workers each "
                             f"(here {hosts.describe()}); set dp.hierarchy=flat or auto")
        return "host" if several and self.hierarchy != "flat" else "flat"


def reduce(grads_and_vars, c, bucket_bytes=None, log=None):
    """`grads_and_vars` with each gradient reduced over the workers of `c` (`Collectives`) along
    the hierarchical route, bucket by bucket (`tfdist.parallel.buckets`; one bucket when
    `bucket_bytes` is None), times the strategy's scale. `log`: the strategy's name, to say how
    once."""
    count = itertools.count(1)  # the buckets, in order: each collective's name

    def reduce_group(grads):
        name = f"tfdist_dp/bucket{next(count)}_{sum(g.shape.num_elements() for g in grads)}"
        return [g * c.scale if c.scale != 1.0 else g
                for g in hierarchy.sum_tensors(grads, c, name)]

    if log:
        buckets.say_once(f"tfdist: {log}: hierarchical all-reduce over {c.hosts.describe()}: "
                         f"reduce-scatter in each host, all-reduce across hosts, all-gather in "
                         f"each host")
    grads_and_vars = [(_dense(g, v), v) for g, v in grads_and_vars]
    return buckets.reduce(grads_and_vars, reduce_group, bucket_bytes, log)


def _dense(grad, variable):
    """`grad` as a dense tensor of its variable's static shape (an embedding's `IndexedSlices`,
    and a gradient whose shape TF's graph leaves unknown, such as a sliced position table's)."""
    if grad is None:
        return grad
    return tf.reshape(tf.convert_to_tensor(grad), variable.shape)
