"""The hosts of `tfdist launch --hosts`: where each task runs, and how it is started and stopped
there (directly on this machine, through ssh on another).

Example:

    >>> from tfdist.launch.hosts import Host
    >>> Host("127.0.0.1").local
    True
"""
import os
import shlex
import signal
import socket
import subprocess

from tfdist.errors import UsageError

DEFAULT_PORT = 12345  # --hosts: the first port of the tasks on each host


def passed_on(name, base):
    """Whether the variable `name` goes with a task started on another host: what the launcher
    set (absent from its own environment `base`), and tfdist's, TF's, Keras's and Python's."""
    return name not in base or name.startswith(("TFDIST_", "TF_", "KERAS_", "PYTHON", "XLA_"))


class Host:
    """A host of `tfdist launch --hosts`: a name or address. Tasks on this machine are started
    directly; on another host with `ssh HOST 'cd <cwd> && exec env VARS... ARGV'` (key-based,
    no prompt: BatchMode), which needs the same paths there (a shared filesystem, as
    horovodrun and mpirun assume). The remote shell first prints its pid, so that stopping the
    task signals the task itself (`ssh HOST kill -SIG PID`), as a local stop would; closing an
    ssh session alone would leave it running."""

    SSH_TIMEOUT = 10  # seconds for ssh to connect, and for a remote kill to return

    def __init__(self, name):
        self.name = name
        try:
            self.address = socket.gethostbyname(name)
        except OSError:
            raise UsageError(f"--hosts: cannot resolve host '{name}'; give names this machine "
                             f"resolves, or addresses") from None
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.bind((self.address, 0))  # only an address of this machine can be bound
            self.local = True
        except OSError:
            self.local = False
        finally:
            probe.close()

    def ssh(self, argv, env):
        script = (f"echo $$ && cd {shlex.quote(os.getcwd())} && exec env "
                  + " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items())) + " "
                  + shlex.join(argv))
        return self._ssh(script)

    def _ssh(self, command):
        return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.SSH_TIMEOUT}",
                self.name, command]

    def kill(self, pid, sig):
        try:
            subprocess.run(self._ssh(f"kill -{signal.Signals(sig).name[3:]} {int(pid)}"),
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=self.SSH_TIMEOUT)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            pass


def send(p, sig):
    """`sig` to the task of Popen `p`: the process itself, or its remote pid through ssh."""
    remote = getattr(p, "tfdist_remote", None)
    if remote and remote[1]:
        remote[0].kill(remote[1][0], sig)
    elif remote and sig == signal.SIGKILL:  # pid not yet known: end the ssh client
        p.kill()
    elif not remote:
        p.send_signal(sig)


