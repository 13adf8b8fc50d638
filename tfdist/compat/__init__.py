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
    runtime.py      the parameter-server coordinator's queue, the profiler's XSpace, Slurm

Example:

    >>> from tfdist import compat
    >>> sorted(compat.PATCHES)[:2]
    ['adam_slots', 'backup_paths']
    >>> compat.PATCHES["symbolic_build_under_mwms"].issue
    'keras-team/keras#20585'
"""
from tfdist.compat.optimizers import (  # noqa: F401
    adam_slots,
    has_gradient_reduction,
    learning_rate_schedule,
    local_variables,
    optimizer_strategy,
    reduce_nothing_in_apply,
    set_gradient_reduction,
    set_learning_rate_schedule,
    update_on_variable_device,
    uses_weight_decay,
)
from tfdist.compat.routing import keras_method, route_keras  # noqa: F401
from tfdist.compat.runtime import (  # noqa: F401
    Tensors,
    pending_closures,
    slurm_tasks_per_node,
    tf_runtime_started,
    xspace,
)
from tfdist.compat.table import PATCHES, PINNED, TESTED, disable, fingerprint, using  # noqa: F401
from tfdist.compat.trainer import (  # noqa: F401
    build_for,
    fix_fit_under_multi_worker,
    flatten_metrics,
    redirect_backup,
    replace_sublayer,
    take_initial_epoch,
    test_step_given,
    track_loss,
    train_function_per_batch,
    train_step_loss,
    train_step_losses,
)
from tfdist.compat.variables import (  # noqa: F401
    empty_storage,
    fill_storage,
    has_storage,
    make_stageable,
    release_storage,
    restore_storage,
    storage,
)
