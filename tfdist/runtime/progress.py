"""Progress on the console, for `tfdist prepare` and for training.

On a terminal it is Keras's progress bar, redrawn in place. Written to a file or a pipe (a Slurm
log, CI, `tfdist launch`'s prefixed output), a redrawn bar would be thousands of carriage returns
on one line: there it is one plain line per `every` updates, and the last one. Either way the
numbers are readable: counts and rates with thousands separators (`tokens: 12,119,372`,
`tok/s: 17,560`), a loss with 4 decimals.

Example (not a terminal, so plain lines):

    >>> import io
    >>> from tfdist.runtime.progress import Progress
    >>> out = io.StringIO()
    >>> bar = Progress(10, unit="step", every=5, stream=out)
    >>> for step in range(1, 11):
    ...     bar.update(step, {"loss": 2.0 / step, "tok/s": 17560.3})
    >>> print(out.getvalue().strip())
    step 5/10 - loss: 0.4000 - tok/s: 17,560
    step 10/10 - loss: 0.2000 - tok/s: 17,560
"""
import sys

#: Values shown as whole numbers with thousands separators, whatever their size.
COUNTS = ("tokens", "tok/s", "steps", "steps/s")


def shown(key, value):
    """`value` of metric `key` as the console shows it."""
    value = float(value)
    if key in COUNTS or abs(value) >= 1000:
        return f"{value:,.0f}"
    if key.endswith("/s"):
        return f"{value:,.1f}"
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4f}"


class _Shown(float):
    """A number Keras's progress bar prints as `shown` prints it (the bar formats every value
    with `.4f`, or `.4e` below 1e-3, and divides it by the count of steps it stands for)."""

    def __new__(cls, key, value):
        number = float.__new__(cls, value)
        number.key = key
        return number

    def __truediv__(self, other):
        return _Shown(self.key, float(self) / other)

    def __format__(self, spec):
        return shown(self.key, self)


class Progress:
    """Progress towards `target` units (`unit`: "step", "MB"), shown on `stream` (stdout).

    `update(current, values)`: `values` a dict (or (name, value) pairs) of numbers to show with
    it. Not on a terminal: a line for every `every` units, and for the last one (or `finalize`)."""

    def __init__(self, target, unit="step", every=1, stream=None):
        self.target = target
        self.unit = unit
        self.every = max(1, every)
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = None
        self._last = 0  # the units at the last line shown
        if self.tty:
            import keras
            # every value shown as given (stateful): tfdist's logs are already per step
            self.bar = keras.utils.Progbar(target, unit_name=unit, stateless_metrics=())

    def update(self, current, values=(), finalize=None):
        values = [(k, v) for k, v in (values.items() if isinstance(values, dict) else values)
                  if v is not None and _is_number(v)]
        done = finalize if finalize is not None else current >= self.target
        if self.bar is not None:
            self.bar.update(current, [(k, _Shown(k, v)) for k, v in values], finalize=done)
            return
        if not done and current // self.every <= self._last // self.every:
            return
        self._last = current
        line = " - ".join([f"{self.unit} {_position(current)}/{_position(self.target)}"]
                          + [f"{k}: {shown(k, v)}" for k, v in values])
        print(line, file=self.stream, flush=True)


def _position(n):
    return f"{n:,}" if isinstance(n, int) else f"{n:,.1f}"


def _is_number(value):
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False
