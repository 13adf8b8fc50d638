"""Local-SGD islands, DiLoCo (Douillard et al. 2023): `config.dp.islands`, `dp.sync_every`.

An island is a group of workers (usually one host's) that trains synchronously inside, under its
strategy, as a group of its own: `tfdist launch --islands=N` starts N groups and restarts each
on its own. Every `sync_every` updates the islands meet at the exchange
(`tfdist.parallel.dp.exchange`, a TCP service of the launcher's, not a collective): each sends
its pseudo-gradient, the outer weights of the last sync less its weights now, in bf16, int8 or
float32 (`dp.exchange`), and every worker applies the islands' mean with the outer optimizer
(SGD with Nesterov momentum: `dp.outer_lr` 0.7, `dp.outer_momentum` 0.9, DiLoCo's), then trains
on from the new outer weights. The inner optimizer keeps its own state.

The outer state (the weights of the last sync, the momentum, the round) lives in host memory and
goes into every backup: a run killed between two syncs resumes exactly. An island that dies
stops no other: the others wait for it at the next sync for at most `dp.sync_timeout` seconds,
then go on; when it is back (its group restarted from its backup) it rejoins, with the current
outer weights if rounds closed without it.

The meeting itself is a callback, `tfdist.callbacks.islands.Sync`, which the strategy adds to
`fit` before tfdist's own (the sync of a step precedes its backup).

Each island reads its own part of every global batch (`input_context`: island k's workers are
pipelines k x W/N + j of all W), so with plain SGD inside, one update between syncs
(`sync_every=1`) and an outer step of lr 1 without momentum, the islands train as synchronous
data parallelism does: the mean of their updates is its update.

Example (the part of the data an island's worker reads):

    >>> import tensorflow as tf
    >>> from tfdist.parallel.dp import islands
    >>> place = islands.Place(island=1, islands=2, exchange="127.0.0.1:1")
    >>> ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1,
    ...                                  num_replicas_in_sync=2)
    >>> c = place.input_context(ctx)
    >>> c.input_pipeline_id, c.num_input_pipelines, c.num_replicas_in_sync
    (3, 4, 4)
"""
import dataclasses

import numpy as np

from tfdist.errors import UsageError
from tfdist.runtime import cluster
from tfdist.runtime.lazy import tf

PREFIX = "tfdist_outer"


@dataclasses.dataclass(frozen=True)
class Place:
    """Where this process is among the islands: `island` of `islands`, the `exchange`'s
    address ("host:port")."""
    island: int = 0
    islands: int = 1
    exchange: str = ""

    @classmethod
    def here(cls):
        """From what `tfdist launch --islands` told this process (one island without it)."""
        return cls(*cluster.island())

    def input_context(self, context):
        """`context` (a tf.distribute.InputContext of this island's group, or None) as a part
        of every island's: this island's pipelines after the islands before it."""
        if self.islands == 1 or context is None:
            return context
        n = context.num_input_pipelines
        return tf.distribute.InputContext(
            num_input_pipelines=n * self.islands,
            input_pipeline_id=self.island * n + context.input_pipeline_id,
            num_replicas_in_sync=context.num_replicas_in_sync * self.islands)


def check_launch(islands):
    """This process's `Place`; UsageError, one line, where it was not started as one of
    `islands` islands (`tfdist launch --islands`), or was and `islands` says otherwise."""
    place = Place.here()
    if place.islands != islands:
        raise UsageError(f"dp.islands={islands}, and the run was started with `tfdist launch "
                         f"--islands={place.islands}`: give both the same number (the launcher "
                         f"starts each island as a group of its own, and their exchange)")
    return place


class Outer:
    """This island's outer state for `settings` (`tfdist.parallel.dp.Settings`): the weights of
    the last sync (`anchor`, flat float32), the momentum and the round, as variables on the
    host (`state`: what a backup keeps), made in scope `local_variables` (the strategy's)."""

    def __init__(self, settings, place, local_variables):
        self.settings, self.place = settings, place
        self.local_variables = local_variables
        self.state = {}

    def get_config(self):
        s = self.settings
        return {"islands": s.islands, "sync_every": s.sync_every, "outer_lr": s.outer_lr,
                "outer_momentum": s.outer_momentum, "exchange": s.exchange}

    def build(self, variables):
        """The state for the trainable `variables` (once). Returns `state`."""
        if not self.state:
            n = sum(int(np.prod(v.shape)) for v in variables)
            with tf.init_scope(), self.local_variables(), tf.device("CPU:0"):
                for name, initial in (("anchor", tf.zeros([n])), ("momentum", tf.zeros([n])),
                                      ("round", tf.constant(-1, tf.int64))):
                    self.state[f"{PREFIX}/{name}"] = tf.Variable(
                        initial, trainable=False, name=f"{PREFIX}_{name}")
        return self.state

    def variable(self, name):
        return self.state[f"{PREFIX}/{name}"]


def attach(optimizer, outer):
    """Makes `outer` the state a backup of `optimizer`'s model keeps (`of`)."""
    optimizer.tfdist_outer = outer


def of(optimizer):
    """The islands' `Outer` state of the strategy that trains `optimizer`, or None."""
    return getattr(optimizer, "tfdist_outer", None)


def settings_of(s):
    """What every island must share (the exchange checks it)."""
    return {"outer_lr": s.outer_lr, "outer_momentum": s.outer_momentum, "exchange": s.exchange,
            "sync_every": s.sync_every, "sync_timeout": s.sync_timeout}
