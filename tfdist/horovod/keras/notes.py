"""One line on stderr, once per process and from rank 0, for an argument of Horovod's Keras API
that has no effect on Keras 3."""
import sys

import horovod.tensorflow as _hvd

_said = set()


def note(what):
    if what not in _said and (not _hvd.is_initialized() or _hvd.rank() == 0):
        _said.add(what)
        print(f"tfdist.horovod.keras: {what}", file=sys.stderr, flush=True)
