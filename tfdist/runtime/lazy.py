"""TensorFlow and Keras, imported at their first use.

Importing TensorFlow costs seconds. The strategy plugins, the config schema and the planner are
read by commands that never run TensorFlow (`tfdist plan`, every `--help`, `tfdist launch`'s
own process), so the modules they import name TensorFlow and Keras through these stand-ins:
the real module is imported when an attribute is first read, and from then on every read is
the module's own.

Example:

    >>> from tfdist.runtime.lazy import tf
    >>> int(tf.constant(2)) * 3
    6
"""
import importlib


class Module:
    """A module imported on the first read of one of its attributes."""

    def __init__(self, name):
        self.__dict__["_name"] = name

    def __getattr__(self, attr):
        if attr.startswith("__") and attr != "__version__":  # probes (doctest, copy, pickle)
            raise AttributeError(attr)  # do not import the module
        return getattr(importlib.import_module(self.__dict__["_name"]), attr)

    def __repr__(self):
        return f"<module {self.__dict__['_name']!r}, imported at first use>"


tf = Module("tensorflow")
keras = Module("keras")
