"""How tfdist starts and supervises its processes (`tfdist launch`, whose command line is
`tfdist/cli/launch.py`).

* `local`: the supervisor: worker processes on 127.0.0.1 or on `--hosts`, restarts, exit
  statuses; `output`: their prefixed output; `hosts`: hosts of `--hosts` (ssh); `bind`: the
  loopback bind shim;
* `elastic`: a group that shrinks when hosts are lost and grows when hosts appear;
* `ray_train`: the workers as Ray Train workers (`tfdist launch --engine=ray`).

The cluster material (Slurm, Kubernetes, TPU VM scripts, the loopback-bind C shim) is in the
repository's `launchers/` directory.
"""
