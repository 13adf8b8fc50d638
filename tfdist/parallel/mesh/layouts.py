"""Keras's `DeviceMesh` and `TensorLayout` as DTensor's `Mesh` and `Layout`, and the checks that
turn a bad mesh or layout into one line.

A variable has two layouts here:
* its **storage** layout, the one the `LayoutMap` gives: the bytes each device holds;
* its **compute** layout, the storage layout without the data-parallel (batch) axis: what a
  layer's matmul reads. A kernel sharded over the batch axis too (keras-hub's maps shard
  `(model, batch)`, after the Gemma team's config) is gathered over that axis when it is read,
  and its gradient scattered back: ZeRO-3 over the batch axis, tensor parallelism over the
  model axis. DTensor's matmul cannot contract two operands sharded over different axes
  ("Contracting dimension for matmul has sharding dimension batch for the left input and model
  for the right input"), which a batch-sharded activation against a batch-sharded kernel would.

Example (a kernel of 6 columns on a mesh of 4 devices along 'model'):

    >>> from tfdist.parallel.mesh import layouts
    >>> try:
    ...     layouts.check_divides("d/kernel", (8, 6), (None, "model"), {"batch": 1, "model": 4})
    ... except Exception as e:
    ...     print(str(e)[:70])
    the layout (None, 'model') of d/kernel (shape (8, 6)) shards its dimen
"""
import numpy as np

from tfdist.errors import UsageError
from tfdist.runtime.lazy import tf

_MESHES = {}  # id(keras DeviceMesh) -> (DeviceMesh, dtensor Mesh)


def dtensor():
    from tensorflow.experimental import dtensor as d
    return d


def device_index(name):
    """The global index of a device named as `list_devices` names them ("cpu:3")."""
    try:
        return int(str(name).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        raise UsageError(f"device {name!r} is not one keras.distribution.list_devices() gives "
                         f"(such as 'cpu:0'); build the DeviceMesh from list_devices()") from None


def backend_mesh(device_mesh):
    """DTensor's `Mesh` of a Keras `DeviceMesh` (one per mesh object): its axes, its devices by
    their global index, and this process's among them. A mesh of more devices than there are
    (over every process) is one line."""
    d = dtensor()
    cached = _MESHES.get(id(device_mesh))
    if cached is not None and cached[0] is device_mesh:
        return cached[1]
    shape, names = tuple(device_mesh.shape), list(device_mesh.axis_names)
    ids = np.array([device_index(n) for n in np.asarray(device_mesh.devices).ravel()])
    total = d.num_global_devices(device_type())
    if ids.size != int(np.prod(shape)) or len(set(ids.tolist())) != ids.size:
        raise UsageError(f"the DeviceMesh {shape} names {ids.size} devices, "
                         f"{len(set(ids.tolist()))} of them different; give it one device "
                         f"per place in its shape")
    if ids.max() >= total:
        raise UsageError(f"the DeviceMesh {shape} needs {int(np.prod(shape))} devices and "
                         f"names device {int(ids.max())}, but there are {total} "
                         f"({d.num_clients()} process(es) x {d.num_local_devices(device_type())});"
                         f" make the mesh smaller, or start more devices "
                         f"(tfdist.parallel.mesh.enable(cpu_devices=N)) or processes")
    local = d.local_devices(device_type())
    first = d.client_id() * len(local)
    mine = [int(i) for i in ids if first <= i < first + len(local)]
    mesh = d.Mesh(names, ids.reshape(shape), mine, [local[i - first] for i in mine])
    _MESHES[id(device_mesh)] = (device_mesh, mesh)
    return mesh


def device_type():
    """The kind of device the mesh spans: GPU or TPU where there are, else CPU (read from the
    physical devices: listing the logical ones would start TF's runtime before DTensor's)."""
    for kind in ("TPU", "GPU"):
        if tf.config.list_physical_devices(kind):
            return kind
    return "CPU"


def backend_layout(tensor_layout):
    """DTensor's `Layout` of a Keras `TensorLayout` (its axes: a mesh axis name or None)."""
    d = dtensor()
    mesh = backend_mesh(tensor_layout.device_mesh)
    names = tensor_layout.device_mesh.axis_names
    for axis in tensor_layout.axes:
        if axis is not None and axis not in names:
            raise UsageError(f"a layout names mesh axis {axis!r}, which the DeviceMesh "
                             f"({', '.join(names)}) does not have; name one of its axes or None")
    return d.Layout([a if a is not None else d.UNSHARDED for a in tensor_layout.axes], mesh)


def check_divides(path, shape, axes, sizes):
    """One line when `axes` (a layout) does not fit `shape`: a rank that differs, or a sharded
    dimension its axis's size does not divide."""
    if len(axes) != len(shape):
        raise UsageError(f"the layout of {path} has {len(axes)} axes {tuple(axes)} for a "
                         f"variable of shape {tuple(shape)}; give one axis (or None) per "
                         f"dimension")
    for dim, (n, axis) in enumerate(zip(shape, axes)):
        if axis is not None and n % sizes[axis]:
            raise UsageError(f"the layout {tuple(axes)} of {path} (shape {tuple(shape)}) shards "
                             f"its dimension {dim} ({n}) over mesh axis {axis!r} "
                             f"({sizes[axis]} devices), which does not divide it: give a layout "
                             f"whose sharded dimensions divide by their axes' sizes, or change "
                             f"the mesh")


def sizes_of(device_mesh):
    return dict(zip(device_mesh.axis_names, device_mesh.shape))


def replicated(mesh, rank):
    return dtensor().Layout.replicated(mesh, rank)


def compute_layout(storage, batch_axis):
    """`storage` without `batch_axis` (see the module's docstring)."""
    d = dtensor()
    specs = [d.UNSHARDED if s == batch_axis else s for s in storage.sharding_specs]
    return d.Layout(specs, storage.mesh)


def to_mesh(value, layout):
    """`value` (a tensor, array, or a DTensor of another layout) as a DTensor of `layout`. A
    value that is not yet on the mesh must be the same on every process (each takes its own
    shards of it)."""
    d = dtensor()
    value = tf.convert_to_tensor(value)
    if not tf.executing_eagerly():
        return d.relayout(value, layout)
    if not d.is_dtensor(value):
        value = d.copy_to_mesh(value, replicated(layout.mesh, value.shape.rank))
    return value if d.fetch_layout(value) == layout else d.relayout(value, layout)


def to_local(value):
    """A DTensor as an ordinary tensor of its whole (global) value, on this process; anything
    else as it is."""
    d = dtensor()
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    if not tf.is_tensor(value) or not d.is_dtensor(value):
        return value
    layout = d.fetch_layout(value)
    whole = d.relayout(value, replicated(layout.mesh, value.shape.rank))
    return d.unpack(whole)[0]


def shard_bytes(value):
    """The bytes of each of this process's shards of a DTensor (or a DTensor variable), by the
    device that holds it."""
    d = dtensor()
    if isinstance(value, tf.Variable):
        value = value.read_value()
    return {t.device: int(np.prod(t.shape)) * t.dtype.size for t in d.unpack(value)}
