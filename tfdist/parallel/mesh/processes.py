"""One process or several: DTensor's clients, and the functions Keras's `keras.distribution`
asks its backend for (`list_devices`, `num_processes`, `distribute_tensor`, ...).

Several processes join as DTensor's clients: `tfdist launch --workers N` gives each worker
TF_CONFIG, and `join_from_tf_config` turns its workers into DTensor's job (`DTENSOR_JOBS`,
`DTENSOR_CLIENT_ID`, ...). Every device then has one global index, client by client:
`list_devices()` is `cpu:0` ... `cpu:{N*K-1}` for N processes of K devices.

Example (the environment a worker of a 2-worker TF_CONFIG gets):

    >>> from tfdist.parallel.mesh import processes
    >>> env = {}
    >>> processes.join_from_tf_config({"cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]},
    ...                                "task": {"type": "worker", "index": 1}}, env)
    >>> env["DTENSOR_CLIENT_ID"], env["DTENSOR_NUM_CLIENTS"], env["DTENSOR_JOBS"]
    ('1', '2', '127.0.0.1:5000,127.0.0.1:5001')
"""
import contextlib
import os
import sys
import tempfile

from tfdist.errors import UsageError
from tfdist.parallel.mesh import layouts
from tfdist.runtime.lazy import tf


def join_from_tf_config(tf_config, env=None):
    """DTensor's client variables from TF_CONFIG's workers (nothing without TF_CONFIG, or where
    DTENSOR_JOBS is set already)."""
    env = os.environ if env is None else env
    cluster = tf_config.get("cluster") or {}
    workers = cluster.get("worker") or []
    if not workers or "DTENSOR_JOBS" in env:
        return
    task = tf_config.get("task") or {}
    if task.get("type") != "worker" or set(cluster) - {"worker", "chief"} or "chief" in cluster:
        raise UsageError("a mesh over several processes runs as workers only (TF_CONFIG has "
                         f"roles {sorted(cluster)}): launch it with tfdist launch --workers N")
    env.update({"DTENSOR_CLIENT_ID": str(task["index"]), "DTENSOR_NUM_CLIENTS": str(len(workers)),
                "DTENSOR_JOB_NAME": "worker", "DTENSOR_JOBS": ",".join(workers)})


def start(device_type):
    """Starts DTensor on this process's devices (and joins the other clients)."""
    d = layouts.dtensor()
    try:
        d.initialize_accelerator_system(device_type)
    except (RuntimeError, ValueError) as e:
        if "already been initialized" in str(e):
            return
        raise UsageError(f"cannot start the mesh: {str(e).splitlines()[0]} (call "
                         f"tfdist.parallel.mesh.enable() before any TensorFlow op)") from None


def list_devices(device_type=None):
    """Every device of the mesh's kind, over every process, by global index ("cpu:3")."""
    kind = (device_type or layouts.device_type()).upper()
    return [f"{kind.lower()}:{i}" for i in range(layouts.dtensor().num_global_devices(kind))]


def get_device_count(device_type=None):
    return len(list_devices(device_type))


def num_processes():
    """1, as Keras's input path is to see it: on tfdist's mesh every process reads the whole
    global batch and keeps its devices' shards of it (`tfdist.parallel.mesh.step`), so Keras's
    own split of a dataset by process (and its refusal of numpy input with several processes)
    stays off. The processes there are: `count()`."""
    return 1


def process_id():
    """0 (see `num_processes`); this process's index among the mesh's: `index()`."""
    return 0


def count():
    """The processes the mesh spans (DTensor's clients)."""
    return layouts.dtensor().num_clients()


def index():
    """This process's index among them."""
    return layouts.dtensor().client_id()


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """`keras.distribution.initialize`: the processes join in `enable`, from TF_CONFIG; here
    only a contradiction is refused."""
    if num_processes is not None and num_processes != count():
        raise UsageError(f"keras.distribution.initialize(num_processes={num_processes}) but "
                         f"{count()} processes joined the mesh; launch them with tfdist launch "
                         f"--workers {num_processes}")


def distribute_tensor(tensor, layout):
    """`tensor` on the mesh in `layout` (a Keras `TensorLayout` or DTensor's `Layout`)."""
    if not isinstance(layout, layouts.dtensor().Layout):
        layout = layouts.backend_layout(layout)
    return layouts.to_mesh(tensor, layout)


def distribute_variable(value, layout):
    """A variable of `value` on the mesh in `layout`."""
    from tfdist.parallel.mesh import variables
    if not isinstance(layout, layouts.dtensor().Layout):
        layout = layouts.backend_layout(layout)
    with tf.init_scope():
        return variables.mesh_variable_class()(layouts.to_mesh(value, layout))


@contextlib.contextmanager
def where_to_write(filepath):
    """Where this process writes a file every process of the mesh saves: process 0 to a file
    beside `filepath`, renamed onto it once whole (a process killed while writing leaves the
    last file whole: Keras's BackupAndRestore writes its backup in place); the others to a
    temporary directory of their own, removed at once."""
    filepath = os.fspath(filepath)
    if index() != 0:
        with tempfile.TemporaryDirectory(prefix="tfdist-mesh-") as directory:
            yield os.path.join(directory, os.path.basename(filepath))
        return
    directory, name = os.path.split(os.path.abspath(filepath))
    partial = os.path.join(directory, f".{os.getpid()}.partial.{name}")  # (its suffix: Keras's)
    try:
        yield partial
        os.replace(partial, filepath)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def backup_began(save_freq):
    """Where a Keras BackupAndRestore of this process writes: None on process 0 (the backup
    directory), on the others a temporary directory of their own, removed when the process
    exits. Process 0 says in one line that a backup made mid-epoch (`save_freq` in batches)
    resumes at its epoch's start, as Keras's callback does on every backend."""
    if index() == 0:
        if save_freq != "epoch":
            print(f"tfdist: warning: BackupAndRestore(save_freq={save_freq}) resumes a backup made "
                  f"within an epoch at that epoch's start (Keras's callback): its steps before "
                  f"the backup run again; back up per epoch (shorter epochs: steps_per_epoch) for "
                  f"a resume at the backed-up step", file=sys.stderr, flush=True)
        return None
    import atexit
    import shutil
    directory = tempfile.mkdtemp(prefix="tfdist-mesh-backup-")
    atexit.register(shutil.rmtree, directory, True)
    return directory


def backend_functions():
    """The functions of Keras's TF backend `distribution_lib` that tfdist gives it."""
    return {"list_devices": list_devices, "get_device_count": get_device_count,
            "num_processes": num_processes, "process_id": process_id, "initialize": initialize,
            "distribute_tensor": distribute_tensor, "distribute_value": distribute_tensor,
            "distribute_variable": distribute_variable,
            "_to_backend_mesh": layouts.backend_mesh, "_to_backend_layout": layouts.backend_layout}
