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
from tfdist.parallel.dp import exchange
from tfdist.runtime import cluster
from tfdist.runtime.lazy import keras, tf

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


def _flat(variables):
    return np.concatenate([np.asarray(v.numpy(), np.float32).ravel() for v in variables])


def _assign(variables, flat):
    at = 0
    for v in variables:
        n = int(np.prod(v.shape))
        v.assign(flat[at:at + n].reshape(v.shape))
        at += n


class Sync(keras.callbacks.Callback):
    """Meets the other islands every `sync_every` updates (before the backup of that step is
    written: it goes before tfdist's callbacks). `outer`: this island's `Outer`; `chief`: this
    worker sends the island's pseudo-gradient."""

    def __init__(self, outer, chief):
        super().__init__()
        self.outer, self.chief = outer, chief
        self.client = None
        self.last = None  # the optimizer's iterations at the last check
        self.rounds = 0  # rounds joined by this process
        self.behind = 0  # times it found rounds closed without it

    def on_train_begin(self, logs=None):
        s, place = self.outer.settings, self.outer.place
        variables = self.model.trainable_weights
        self.outer.build(variables)
        anchor, momentum, round_ = (self.outer.variable(k) for k in ("anchor", "momentum",
                                                                      "round"))
        if int(round_.numpy()) < 0:  # a new run: the outer weights are the first ones
            anchor.assign(_flat(variables))
            round_.assign(0)
        self.client = exchange.Client(place.exchange, place.island, self.chief,
                                      timeout=2 * s.sync_timeout + 120)
        answer = self.client.hello(int(round_.numpy()), _settings(s), anchor.numpy(),
                                   momentum.numpy())
        if answer[0] == "behind":
            self._take(*answer[1:])
        elif self.chief:
            print(f"tfdist: island {place.island} of {place.islands}: meeting the others every "
                  f"{s.sync_every} update(s) at {place.exchange} (round {answer[1]}; outer SGD, "
                  f"lr {s.outer_lr:g}, Nesterov momentum {s.outer_momentum:g}; deltas in "
                  f"{s.exchange})", flush=True)
        self.last = int(self.model.optimizer.iterations.numpy())

    def _take(self, round_, theta, momentum):
        """Rounds closed without this island: it goes on from the outer state of now."""
        self.behind += 1
        if self.chief:
            print(f"tfdist: island {self.outer.place.island}: rejoining at round {round_} with "
                  f"the current outer weights", flush=True)
        self.outer.variable("anchor").assign(theta)
        self.outer.variable("momentum").assign(momentum)
        self.outer.variable("round").assign(round_)
        _assign(self.model.trainable_weights, theta)

    def on_train_batch_end(self, batch, logs=None):
        s = self.outer.settings
        now = int(self.model.optimizer.iterations.numpy())
        if now == self.last:
            return
        self.last = now
        if now % s.sync_every:
            return
        anchor_var = self.outer.variable("anchor")
        round_ = int(self.outer.variable("round").numpy())
        anchor = np.array(anchor_var.numpy())  # (a copy: the outer step works in place)
        delta = anchor - _flat(self.model.trainable_weights) if self.chief else None
        status, got = self.client.sync(round_, delta)
        if status == "behind":
            self._take(*got)
            return
        momentum = np.array(self.outer.variable("momentum").numpy())
        exchange.outer_step(anchor, momentum, got, s.outer_lr, s.outer_momentum)
        anchor_var.assign(anchor)
        self.outer.variable("momentum").assign(momentum)
        self.outer.variable("round").assign(round_ + 1)
        _assign(self.model.trainable_weights, anchor)
        self.rounds += 1

    def on_train_end(self, logs=None):
        if self.client is not None:
            self.client.close()
            self.client = None


def _settings(s):
    """What every island must share (the exchange checks it)."""
    return {"outer_lr": s.outer_lr, "outer_momentum": s.outer_momentum, "exchange": s.exchange,
            "sync_every": s.sync_every, "sync_timeout": s.sync_timeout}
