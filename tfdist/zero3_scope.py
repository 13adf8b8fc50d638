"""The scope in which ZeRO-3 (tfdist/zero3.py) runs a model's layers: a Keras `StatelessScope`
whose variables' values are given (a unit's gathered weights), or gathered where they are read.

Example (one replica: a weight read in the scope is its gathered value):

    >>> import keras, numpy as np
    >>> from tfdist import zero, zero3
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
    >>> params = zero3.shard(model, zero.local())
    >>> with zero3.Gathering(params):
    ...     float(np.sum(model.layers[0].kernel))
    2.0
"""
import threading

from tfdist.lazy import keras


class Gathering(keras.StatelessScope):
    """A Keras stateless scope in which a sharded weight that `mapping` does not give is gathered
    where it is read (`Parameters.gather`: once per unit and scope; each time it is read, with
    `reuse=False`), and in which assignments are recorded (`updated`) for `apply_updates` to make
    after it. A value it lacks is looked up in the Gathering scope it is inside."""

    entered = threading.local()  # .scopes: the Gathering scopes this thread entered, innermost last

    def __init__(self, params, mapping=None, reuse=True):
        super().__init__(mapping or [], initialize_variables=False)
        self.params, self.updated, self._variables, self._read = params, {}, {}, {}
        self.parent, self.reuse = None, reuse

    def __enter__(self):
        scopes = Gathering.entered.__dict__.setdefault("scopes", [])
        self.parent = scopes[-1] if scopes else None
        scopes.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        Gathering.entered.scopes.remove(self)
        return super().__exit__(*exc)

    def add_update(self, update):
        variable, value = update
        super().add_update(update)
        self.updated[id(variable)] = value
        self._variables[id(variable)] = variable

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        home = self.params.home.get(id(variable))
        if value is None and home is not None:
            u, i = home
            if u not in self._read or not self.reuse:
                self._read[u] = self.params.gather(self.params.units[u])
            value = self._read[u][i]
        if value is None and self.parent is not None:  # updated in the enclosing scope (an
            value = self.parent.get_current_value(variable)  # RNG state, by a microbatch before)
        return value

    def apply_updates(self):
        for key, value in self.updated.items():
            self._variables[key].assign(value)
