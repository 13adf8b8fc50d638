"""Keras's file-writing callbacks on a process that is not the chief (`Strategy.for_this_process`):
a user's ModelCheckpoint writes to a directory removed at the end, a BackupAndRestore reads the
chief's backup and writes nothing of its own."""
import os
import tempfile

import keras

from tfdist import compat
from tfdist.callbacks.backup import remove

_HOOKS = [name for name in dir(keras.callbacks.Callback) if name.startswith("on_")]


class Scratch(keras.callbacks.Callback):
    """A file-writing callback run with its path (attribute `attr`) in a temporary directory,
    removed when training ends: on a worker that must take part in a collective save but whose
    file nobody reads. Every hook it does not define itself goes to the wrapped callback."""

    def __init__(self, callback, attr=None):
        super().__init__()
        self.callback = callback
        self.scratch = tempfile.mkdtemp(prefix="tfdist-scratch-")
        if attr:
            setattr(callback, attr, os.path.join(self.scratch, os.path.basename(
                str(getattr(callback, attr)))))
        for name in _HOOKS:
            if getattr(type(self), name) is getattr(keras.callbacks.Callback, name):
                setattr(self, name, self._hook(name))

    def _hook(self, name):
        return getattr(self.callback, name)

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def on_train_end(self, logs=None):
        self.callback.on_train_end(logs)
        remove(self.scratch)


class ReadOnlyBackup(Scratch):
    """Keras's BackupAndRestore on a worker that is not the chief: it restores from the chief's
    backup (the directory must be shared, as Keras requires), then writes only to a temporary
    directory (`collective`: saving takes every worker) or not at all, and deletes nothing."""

    def __init__(self, callback, collective):
        self.collective = collective
        super().__init__(callback)

    def _hook(self, name):
        return getattr(self.callback, name) if self.collective else (lambda *a, **k: None)

    def on_train_begin(self, logs=None):
        self.callback.on_train_begin(logs)  # reads the chief's backup
        compat.redirect_backup(self.callback, self.scratch)

    def on_train_end(self, logs=None):
        remove(self.scratch)  # not the chief's backup


class Calls(keras.callbacks.Callback):
    """A callback made of functions: `Calls(name, on_train_begin=f, ...)` calls
    `f(model, *args, **kwargs)` at that hook with Keras's arguments, as Keras passes them
    (`logs=None`; `epoch, logs=None`; `batch, logs=None`).
    A strategy plugin says what it does at Keras's hook points with it, in its own file, without
    a Keras class of its own (a plugin is read without importing Keras).

    Example:

        Calls("average_logs", on_epoch_end=lambda model, epoch, logs=None: print(epoch, logs))
    """

    def __init__(self, name, **functions):
        super().__init__()
        self.name = name
        unknown = sorted(set(functions) - set(_HOOKS))
        if unknown:
            raise ValueError(f"not Keras callback hooks: {unknown}")
        for hook, function in functions.items():
            setattr(self, hook, lambda *args, f=function, **kw: f(self.model, *args, **kw))

    def __repr__(self):
        return f"<Calls {self.name}>"
