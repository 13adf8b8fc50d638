"""The hosts of `tfdist launch --hosts`: where each task runs, and how it is started and stopped
there (directly on this machine, through ssh on another).

Example:

    >>> from tfdist.launch.hosts import Host
    >>> Host("127.0.0.1").local
    True
"""
import os
import shlex
import socket

from tfdist.errors import UsageError

DEFAULT_PORT = 12345  # --hosts: the first port of the tasks on each host


def passed_on(name, base):
    """Whether the variable `name` goes with a task started on another host: what the launcher
    set (absent from its own environment `base`), and tfdist's, TF's, Keras's and Python's."""
    return name not in base or name.startswith(("TFDIST_", "TF_", "KERAS_", "PYTHON", "XLA_"))


class Host:
    """A host of `tfdist launch --hosts`: a name or address. Its agent (`tfdist.launch.agent`,
    which starts its tasks) runs here when the host is this machine, else through `ssh HOST 'cd
    <cwd> && exec env VARS... ARGV'` (key-based, no prompt: BatchMode), which needs the same
    paths there (a shared filesystem, as horovodrun and mpirun assume). Its tasks are stopped
    through their agent; an ssh connection that stops answering ends within about
    3 x ALIVE_INTERVAL seconds (ssh's ServerAlive), and the host counts as lost."""

    SSH_TIMEOUT = 10  # seconds for ssh to connect, and for an agent to answer a stop
    ALIVE_INTERVAL = 2  # seconds between ssh's keepalives to a host's agent

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

    def remote(self, argv, env):
        """The command that runs `argv` on this host with the variables `env`, in this
        directory."""
        script = (f"cd {shlex.quote(os.getcwd())} && exec env "
                  + " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items())) + " "
                  + shlex.join(argv))
        return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.SSH_TIMEOUT}",
                "-o", f"ServerAliveInterval={self.ALIVE_INTERVAL}", "-o", "ServerAliveCountMax=3",
                self.name, script]
