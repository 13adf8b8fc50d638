"""The launcher's console: every process's output, line by line, with its prefix (`[w0] `, `[c0] `,
`[r1] ` for a Horovod rank), TensorFlow's start-up notices left out.

Example:

    >>> import io
    >>> from tfdist.launch.output import Output
    >>> out = io.StringIO()
    >>> Output(out).line("[w0] step 3/10 - loss: 2.0000")
    >>> out.getvalue().splitlines()
    ['[w0] step 3/10 - loss: 2.0000']
"""
import os
import re
import sys
import threading

from tfdist.runtime import console


class Output:
    """Writes the workers' output line by line with a prefix.

    Keras's progress bar redraws one line with carriage returns. On a terminal the latest state is
    shown in place. Elsewhere (a pipe, a log file) only the line's final state is written.
    """

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.lock = threading.Lock()
        self._open = False  # a progress line is being redrawn on the terminal

    def line(self, text, log=None):
        if _is_noise(text):
            return
        if not self.tty:
            text = _ANSI.sub("", text)
        with self.lock:
            if self._open:
                self.stream.write("\n")
                self._open = False
            self.stream.write(text + "\n")
            self.stream.flush()
            if log:
                log.write(_ANSI.sub("", text) + "\n")
                log.flush()

    def progress(self, text):
        if not self.tty or _is_noise(text):
            return
        with self.lock:
            self.stream.write("\r" + text)
            self.stream.flush()
            self._open = True

    def pump(self, fd, prefix, log=None, header=None):
        """Copies a worker's output (file descriptor `fd`) until it closes. `header`, if given,
        receives the first line instead."""
        buf = b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                if header:
                    header(raw.decode(errors="replace").strip())
                    header = None
                    continue
                self.line(_ranks(prefix + _last_state(raw)), log)
            if b"\r" in buf:
                self.progress(_ranks(prefix + _last_state(buf)))
        if buf:
            self.line(_ranks(prefix + _last_state(buf)), log)
        os.close(fd)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _ranks(text):
    """horovodrun's `[1]<stdout>:` prefix becomes `[r1] `, like the other launchers' `[w1] `."""
    return _HOROVOD_PREFIX.sub(r"[r\1] ", text)


_HOROVOD_PREFIX = re.compile(r"^\[hvd\] \[(\d+)\]<std(?:out|err)>:")


def _last_state(raw):
    segments = [s for s in raw.decode(errors="replace").replace("\b", "").split("\r") if s.strip()]
    return segments[-1].rstrip() if segments else ""


def _is_noise(text):
    """TF's start-up notices (tfdist.runtime.console.NOISE), from any program the workers run: N
    workers would print them 2N times. They carry no information about the run."""
    return console.is_noise(text)


