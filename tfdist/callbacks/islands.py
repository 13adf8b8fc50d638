"""The islands' sync (`config.dp.islands`, `tfdist.parallel.dp.islands`): every `sync_every`
updates each worker meets the other islands at the exchange (`tfdist.parallel.dp.exchange`),
and every worker of every island applies the same outer step.

The strategy adds it to `fit` before the others' callbacks (`Strategy.dp_callbacks`), so that a
step's sync comes before its backup: a backup holds the outer state of the weights it holds.

Example (one island, alone at its exchange: each sync applies its own delta with lr 1):

    >>> import contextlib, keras, tensorflow as tf
    >>> from tfdist.callbacks.islands import Sync
    >>> from tfdist.parallel import dp
    >>> from tfdist.parallel.dp import exchange, islands
    >>> server = exchange.serve_in_thread("127.0.0.1", islands=1)
    >>> s = dp.Settings(islands=2, sync_every=2, outer_lr=1.0, outer_momentum=0.0,
    ...                 exchange="float32")
    >>> outer = islands.Outer(s, islands.Place(0, 1, server.address), contextlib.nullcontext)
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    >>> data = tf.data.Dataset.from_tensors((tf.ones((4, 2)), tf.ones((4, 1)))).repeat()
    >>> sync = Sync(outer, chief=True)
    >>> import io
    >>> with contextlib.redirect_stdout(io.StringIO()) as said:
    ...     _ = model.fit(data, epochs=1, steps_per_epoch=4, callbacks=[sync], verbose=0)
    >>> said.getvalue()[:62]
    'tfdist: island 0 of 1: meeting the others every 2 update(s) at'
    >>> sync.rounds, int(outer.variable("round").numpy())
    (2, 2)
    >>> server.shutdown()
"""
import keras
import numpy as np

from tfdist.parallel.dp import exchange
from tfdist.parallel.dp.islands import settings_of


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
        answer = self.client.hello(int(round_.numpy()), settings_of(s), anchor.numpy(),
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
