"""Every use of Keras's and TensorFlow's private internals, in one place: the patch table.

A Keras or TF upgrade is this project's largest risk: each function here reaches into something
upstream does not promise to keep. `table.py` lists them: for each row, the functions, the
upstream code they rely on, the upstream issue (or why there is none), what breaks without it,
the test that fails without it, and a fingerprint of its targets' source at the tested versions.
On other versions tfdist says so in one line at start and refuses the rows whose targets changed
(`table.using`). `tests/test_compat.py` fails if a private attribute of anything but tfdist's own
object is used outside this package, or here outside a function the table names. Modules that
need no patch import nothing from here.

    optimizers.py   how Keras 3's optimizers reduce, clip and place their updates; schedules
    trainer.py      the loss metric, the symbolic build, fit under MultiWorkerMirrored, backups
    routing.py      a user's compile/fit/evaluate/predict/save routed to the strategy plugin
    runtime.py      the parameter-server coordinator's queue, the profiler's XSpace, Slurm,
                    whether TF's runtime has started
    variables.py    a Keras variable without its storage, and with it again (ZeRO-3)
    horovod.py      horovodrun's build check, answered without importing TensorFlow
    distribution.py keras.distribution on the TF backend (tfdist.parallel.mesh)

Each module is imported at the first use of one of its functions: `horovod.py` imports neither
Keras nor TensorFlow, so `tfdist.launch.horovodrun` uses it without them; the others import
both. The version guard runs at the first use of a row (`table.using`).

Example:

    >>> from tfdist import compat
    >>> sorted(compat.PATCHES)[:2]
    ['adam_slots', 'backup_paths']
    >>> compat.PATCHES["symbolic_build_under_mwms"].issue
    'keras-team/keras#20585'
"""
import importlib

from tfdist.compat.table import PATCHES, PINNED, TESTED, disable, fingerprint, using  # noqa: F401

#: The module of tfdist/compat/ that holds each function the rest of tfdist calls.
_MODULES = {
    "optimizers": ("adam_slots", "has_gradient_reduction", "learning_rate_schedule",
                   "local_variables", "optimizer_strategy", "reduce_nothing_in_apply",
                   "set_gradient_reduction", "set_learning_rate_schedule",
                   "update_on_variable_device", "uses_weight_decay"),
    "routing": ("keras_method", "route_keras"),
    "runtime": ("Tensors", "configure_heartbeats", "pending_closures", "slurm_tasks_per_node",
                "tf_runtime_started", "xspace"),
    "trainer": ("build_for", "fix_fit_under_multi_worker", "flatten_metrics", "redirect_backup",
                "replace_sublayer", "take_initial_epoch", "test_step_given", "track_loss",
                "train_function_per_batch", "train_step_loss", "train_step_losses"),
    "variables": ("empty_storage", "fill_storage", "has_storage", "make_stageable",
                  "release_storage", "restore_storage", "storage"),
    "horovod": ("horovod_built", "patch_horovodrun"),
    "distribution": ("current_distribution", "install_mesh_backend", "install_mesh_backups",
                     "install_mesh_generate",
                     "install_mesh_saving", "install_mesh_slice_update", "install_mesh_trainer",
                     "install_mesh_variables", "symbolic_build"),
}
_HOLDER = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name):
    module = _HOLDER.get(name)
    if module is None:
        raise AttributeError(f"module 'tfdist.compat' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tfdist.compat.{module}"), name)


def __dir__():
    return sorted([*globals(), *_HOLDER])
