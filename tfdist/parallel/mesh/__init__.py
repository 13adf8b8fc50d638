"""Keras's own model-parallel API, `keras.distribution`, on TensorFlow: a `DeviceMesh`, a
`LayoutMap` (keras-hub's `get_layout_map`, or one's own) and `ModelParallel` or `DataParallel`
shard a model over the devices of one process or of several, through TensorFlow's SPMD engine,
DTensor. On Keras 3.15's TF backend the same program leaves every variable whole on one device
without a word (docs/parallelism.md, "Keras's distribution API").

One tfdist line, before TensorFlow starts, turns it on: `enable`. The rest is Keras's:

    import keras, keras_hub
    from tfdist.parallel import mesh
    mesh.enable(cpu_devices=4)          # on CPU: 4 logical devices; GPUs/TPUs: the real ones
    devices = keras.distribution.list_devices()
    device_mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(device_mesh),
        batch_dim_name="batch"))
    model = keras_hub.models.LlamaCausalLM(...)    # each kernel sharded as the map says
    model.compile(...); model.fit(...); model.predict(...); model.generate(...)

Under `tfdist launch --workers N -- python program.py`, `enable` joins the N processes into one
mesh (TF_CONFIG's workers: DTensor's clients); `list_devices` then names every process's devices.

The parts: `layouts` (Keras's mesh and layouts as DTensor's, and the checks), `variables` (a
Keras variable on the mesh), `step` (fit, evaluate and predict on the mesh), `processes` (one
process or several), and `tfdist.compat.distribution` (where Keras is hooked).

Example:

    >>> from tfdist.parallel import mesh
    >>> mesh.enabled()
    False
"""
import json
import os

from tfdist.errors import UsageError
from tfdist.parallel.mesh import layouts, ops, processes, step, variables

_STATE = {"enabled": False}


def enabled():
    """Whether `enable` has run in this process."""
    return _STATE["enabled"]


def enable(cpu_devices=None):
    """Makes `keras.distribution` work on TensorFlow in this process. `cpu_devices=N` splits the
    CPU into N logical devices (a machine without GPUs or TPUs). Call it before any TensorFlow op;
    once is enough (a second call does nothing)."""
    if _STATE["enabled"]:
        return
    if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
        raise UsageError(f"tfdist's mesh is Keras's distribution API on TensorFlow; "
                         f"KERAS_BACKEND is {os.environ['KERAS_BACKEND']!r}, whose own "
                         f"keras.distribution needs no tfdist")
    processes.join_from_tf_config(json.loads(os.environ.get("TF_CONFIG") or "{}"))
    if cpu_devices:
        from tfdist.parallel.layout import configure_logical_cpus
        configure_logical_cpus(int(cpu_devices))
    processes.start(layouts.device_type())
    from tfdist import compat
    compat.install_mesh_backend(processes.backend_functions())
    compat.install_mesh_variables(_create, variables.read, variables.on_mesh, _to_local)
    compat.install_mesh_slice_update(ops.slice_update)
    compat.install_mesh_generate(step.generate_function, variables.on_mesh)
    compat.install_mesh_saving(processes.where_to_write, variables.on_mesh)
    compat.install_mesh_backups(processes.backup_began, variables.on_mesh)
    from tfdist.models import fused
    fused.use_xla(False)  # DTensor runs no XLA-compiled function (tfdist's GPT-2's GELU)
    compat.install_mesh_trainer(step.train_function, step.test_function, step.predict_function,
                                variables.on_mesh)
    from tfdist.errors import install_excepthook, translate_usage_errors
    from tfdist.runtime import cluster
    install_excepthook(cluster.report_exit)
    translate_usage_errors(_keras_mesh_error)
    _STATE["enabled"] = True


def _keras_mesh_error(value, traceback):
    """Keras's own check of a DeviceMesh or LayoutMap (a ValueError raised in
    keras/src/distribution/), as one line naming the devices there are."""
    import traceback as tb
    frames = tb.extract_tb(traceback)
    if not isinstance(value, ValueError) or not frames or \
            "keras/src/distribution/" not in frames[-1].filename.replace("\\", "/"):
        return None
    there = len(processes.list_devices())
    return (f"keras.distribution: {' '.join(str(value).split())} (there are {there} devices, "
            f"over {processes.count()} process(es); tfdist.parallel.mesh.enable("
            f"cpu_devices=N) makes N on a CPU)")


def _create(variable, value, layout, explicit):
    from tfdist import compat
    return variables.create(variable, value, layout, explicit,
                            getattr(compat.current_distribution(), "batch_dim_name", None))


def _to_local(storage):
    return layouts.to_local(storage.read_value())


def model_on_mesh(model):
    """Whether the model's variables live on a mesh."""
    from tfdist import compat
    return any(variables.on_mesh(compat.storage(v)) for v in model.variables)
