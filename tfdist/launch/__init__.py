"""How tfdist starts its processes on one machine.

* `tfdist.launch.cli`: the `tfdist launch` command line.
* `tfdist.launch.local`: the supervisor behind it (worker processes on 127.0.0.1, restarts).

The cluster material (Slurm, Kubernetes, TPU VM scripts, the loopback-bind C shim) is in the
repository's `launchers/` directory.
"""
