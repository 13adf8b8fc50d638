"""`parameter_server`: asynchronous data parallelism (variables on ps tasks, steps on workers).

Its plugin (`plugin.py`: the cluster's roles, serving, a user's `evaluate` and `predict`) and its
training loop on the chief (`loop.py`: Keras's `fit` as a `ClusterCoordinator` loop), one
strategy in one folder.
"""
from tfdist.strategies.parameter_server.plugin import ParameterServer  # noqa: F401
