"""Keras's `keras.distribution` on the TensorFlow backend (tfdist's mesh:
`tfdist.parallel.mesh`): the places in Keras 3.15 where the TF backend ignores a distribution.

* "mesh_backend": the TF backend's `distribution_lib` is a prototype ("!!!DO NOT USE!!!"): no
  `num_processes` (keras-team/keras#18983), no `distribute_tensor`, and `list_devices` names a
  second process's devices as the first's. tfdist gives it the mesh's functions.
* "mesh_variables": the TF backend's `Variable` creates a whole `tf.Variable` on one device
  under any distribution (keras-team/keras#18473: variables are sharded on JAX only). Under a
  distribution, tfdist creates each as a DTensor variable in the layout the distribution gives.
* "mesh_trainer": Keras's train, test and predict functions read their batches inside a
  `tf.function`, which DTensor cannot lay out ("Could not find `tf._element_layouts`
  attribute"), and run the whole step in one function, where DTensor loses the order of a
  variable's write and a later read of it (Adam read its moments as zero, and no weight moved).

Each function names its row of the patch table (`tfdist/compat/table.py`).
"""
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow import core as _core
from keras.src.backend.tensorflow import distribution_lib as _tf_distribution_lib
from keras.src.backend.tensorflow import trainer as _tf_trainer

from tfdist.compat.table import using

_KERAS = {}  # what each hook replaced: Keras's own


def _model_on_mesh(model, on_mesh):
    """Whether any of `model`'s variables has a storage that `on_mesh`."""
    return any(on_mesh(v._value) for v in model.variables)


def install_mesh_backend(functions):
    """Gives the TF backend's `distribution_lib` tfdist's functions (name -> function), once
    ("mesh_backend")."""
    if not using("mesh_backend"):
        return
    for name, function in functions.items():
        _KERAS.setdefault(("lib", name), getattr(_tf_distribution_lib, name, None))
        setattr(_tf_distribution_lib, name, function)


def current_distribution():
    """The distribution `keras.distribution.set_distribution` set (or None)."""
    return global_state.get_global_attribute("distribution")


def install_mesh_variables(create, read, on_mesh, to_local):
    """A Keras variable created under a distribution gets the storage `create(variable, value,
    layout, explicit)` makes (`layout`: the one given, `explicit`, else the distribution's); a
    read of a variable whose storage is `on_mesh` is `read(storage, tensor)`, and its numpy value
    `to_local(storage)` ("mesh_variables")."""
    if not using("mesh_variables"):
        return
    if ("var", "_initialize") in _KERAS:
        return
    cls = _core.Variable
    own = {name: cls.__dict__[name] for name in ("_initialize", "__tf_tensor__", "numpy")}
    _KERAS.update({("var", k): v for k, v in own.items()})

    def _initialize(self, value):
        distribution = current_distribution()
        if distribution is None or isinstance(value, tf.Variable):
            return own["_initialize"](self, value)
        if self._shape is None:
            self._shape = self._validate_shape(value.shape)
        explicit = self._layout is not None
        if not explicit:
            self._layout = distribution.get_variable_layout(self)
        self._value = create(self, value, self._layout, explicit)

    def __tf_tensor__(self, dtype=None, name=None):
        tensor = own["__tf_tensor__"](self, dtype=dtype, name=name)
        return read(self._value, tensor) if on_mesh(self._value) else tensor

    def numpy(self):
        if on_mesh(self._value):
            return to_local(self._value).numpy()
        return own["numpy"](self)

    def __array__(self, dtype=None):
        import numpy as np
        return np.asarray(self.numpy(), dtype=dtype)

    cls._initialize, cls.__tf_tensor__, cls.numpy = _initialize, __tf_tensor__, numpy
    cls.__array__ = __array__


def install_mesh_trainer(train, test, predict, on_mesh):
    """A model whose variables `on_mesh` gets its train, test and predict functions from
    `train(model)`, `test(model, keras_function)` and `predict(model, keras_function)`
    ("mesh_trainer")."""
    if not using("mesh_trainer"):
        return
    cls = _tf_trainer.TensorFlowTrainer
    if ("trainer", "make_train_function") in _KERAS:
        return
    own = {name: cls.__dict__[name] for name in
           ("make_train_function", "make_test_function", "make_predict_function")}
    _KERAS.update({("trainer", k): v for k, v in own.items()})

    def mesh_model(model):  # (a model not yet built: it will be built on the mesh)
        if not model.variables:
            return current_distribution() is not None
        return _model_on_mesh(model, on_mesh)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        if not mesh_model(self):
            return own["make_train_function"](self, force)
        self.train_function = train(self)
        return self.train_function

    def wrapping(kind, wrap):  # Keras's own function, then wrapped for a model on the mesh
        def make(self, force=False):
            if getattr(self, f"{kind}_function") is not None and not force:
                return getattr(self, f"{kind}_function")
            own[f"make_{kind}_function"](self, force)
            if mesh_model(self):
                setattr(self, f"{kind}_function", wrap(self, getattr(self, f"{kind}_function")))
            return getattr(self, f"{kind}_function")
        return make

    cls.make_train_function = make_train_function
    cls.make_test_function = wrapping("test", test)
    cls.make_predict_function = wrapping("predict", predict)


def symbolic_build(model, batch):
    """Builds the model, its compiled loss and metrics from a first batch, before any step
    ("mesh_trainer": variables made inside the first step's function are made as that
    function's first trace runs, and that step's update was lost)."""
    using("mesh_trainer")
    model._symbolic_build(data_batch=batch)


def install_mesh_slice_update(slice_update):
    """Keras's `ops.slice_update` on the TF backend becomes `slice_update(inputs, start_indices,
    updates)` ("mesh_slice_update": Keras's is XLA's DynamicUpdateSlice, for which DTensor has no
    layout propagation; keras-hub's generate updates its KV cache with it)."""
    if not using("mesh_slice_update"):
        return
    _KERAS.setdefault(("core", "slice_update"), _core.slice_update)
    _core.slice_update = slice_update


def install_mesh_generate(wrap, on_mesh):
    """keras-hub's `CausalLM.generate` on a model whose variables `on_mesh`: its generate
    function becomes `wrap(model, function)` ("mesh_generate": keras-hub hands it numpy prompts
    and concatenates its outputs as numpy, neither of which a mesh's DTensors are). Nothing
    where keras-hub is not installed."""
    import importlib.util
    if importlib.util.find_spec("keras_hub") is None:
        return
    from keras_hub.src.models import causal_lm
    if not using("mesh_generate"):
        return
    cls = causal_lm.CausalLM
    if ("hub", "make_generate_function") in _KERAS:
        return
    own = _KERAS.setdefault(("hub", "make_generate_function"), cls.make_generate_function)

    def make_generate_function(self):
        already = self.generate_function is not None
        own(self)
        if not already and _model_on_mesh(self, on_mesh):
            self.generate_function = wrap(self, self.generate_function)
        return self.generate_function

    cls.make_generate_function = make_generate_function


def install_mesh_saving(where, on_mesh):
    """`Model.save` and `save_weights` of a model whose variables `on_mesh` write to the path
    the context manager `where(filepath)` gives ("mesh_saving": every process of a mesh must
    read the variables, a collective, but only one may write the file; Keras's save writes from
    every process)."""
    if not using("mesh_saving"):
        return
    from keras.src.models import model as _model
    cls = _model.Model
    if ("model", "save") in _KERAS:
        return
    own = {name: cls.__dict__[name] for name in ("save", "save_weights")}
    _KERAS.update({("model", k): v for k, v in own.items()})

    def wrap(name):
        def method(self, filepath, *args, **kwargs):
            if not _model_on_mesh(self, on_mesh):
                return own[name](self, filepath, *args, **kwargs)
            with where(filepath) as path:
                return own[name](self, path, *args, **kwargs)
        method.__name__ = name
        return method

    cls.save, cls.save_weights = wrap("save"), wrap("save_weights")


def install_mesh_backups(began, on_mesh):
    """Keras's `BackupAndRestore` on a model whose variables `on_mesh`: every process restores
    from the backup, then `began(save_freq)` gives None (process 0: it writes the backups) or a
    directory of the process's own where it writes (and at the end removes) its copies
    ("mesh_backups": Keras's callback writes and removes its files from every process; the last
    to end removed the directory while the first still wrote its last backup)."""
    if not using("mesh_backups"):
        return
    from keras.src.callbacks import backup_and_restore
    cls = backup_and_restore.BackupAndRestore
    if ("backup", "on_train_begin") in _KERAS:
        return
    own = _KERAS.setdefault(("backup", "on_train_begin"), cls.on_train_begin)

    def on_train_begin(self, logs=None):
        own(self, logs)
        if _model_on_mesh(self.model, on_mesh):
            directory = began(self.save_freq)
            if directory is not None:
                from tfdist.compat.trainer import redirect_backup
                redirect_backup(self, directory)

    cls.on_train_begin = on_train_begin
