"""How tfdist runs are started.

* `launchers.local`: `tfdist launch`, a supervised cluster of worker processes on 127.0.0.1.
* `launchers/slurm/`: an sbatch script (the cluster comes from Slurm's environment).
* `launchers/kubernetes/`: a Kubeflow TFJob manifest (the cluster comes from TF_CONFIG).
"""
