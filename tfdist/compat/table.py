"""The table of tfdist's patches of Keras and TensorFlow internals, and the version guard.

Each row is one workaround: the tfdist functions that carry it (`tfdist.compat`), the upstream
code it relies on (`targets`, "module:qualified.name", linked in docs/upstream.md), the upstream
issue it works around (or, where none was found, why it is needed), what breaks without it, the
test that fails without it, and a fingerprint of its targets' source at the versions it was
tested on (`TESTED`).

On any other Keras or TensorFlow version, the first use of a patch says so in one line, and
compares each row's fingerprint with the installed targets': a row whose target changed is
refused (`using` raises a one-line `UsageError` when a run needs it); one whose target is the
same applies as tested. Nothing is applied silently on code it was not written for. A row whose
targets are Horovod's is guarded by Horovod's version the same way (`TESTED_HOROVOD`), without
importing Keras or TensorFlow.
`TFDIST_DISABLE_PATCHES=<row>,...` (or `disable`) switches rows off, to show what each is for:
run its test with it off.

Example:

    >>> from tfdist.compat import table
    >>> table.TESTED
    {'keras': '3.15.1', 'tensorflow': '2.21.0'}
    >>> table.version_line({"keras": "3.16.0", "tensorflow": "2.21.0"}, refused=["xspace"])[:58]
    'tfdist: warning: keras 3.16.0 (tfdist is tested with 3.15.'
"""
import dataclasses
import hashlib
import importlib
import inspect
import os
import sys

from tfdist.errors import UsageError

#: The versions every row was written and tested for.
TESTED = {"keras": "3.15.1", "tensorflow": "2.21.0"}
PINNED = TESTED  # (its earlier name)
#: The Horovod version its rows (targets in `horovod.`) were written and tested for.
TESTED_HOROVOD = "0.28.1"

_K = "keras.src.backend.tensorflow.trainer:TensorFlowTrainer"
_OPT = "keras.src.backend.tensorflow.optimizer:TFOptimizer"


@dataclasses.dataclass(frozen=True)
class Patch:
    functions: tuple  # the tfdist.compat functions that carry it
    targets: tuple  # the upstream code it relies on: "module:qualified.name" (or a module)
    issue: str  # the upstream issue, or "none found: <why it is needed>"
    breaks: str  # what goes wrong without it
    test: str  # the test that fails without it
    fingerprint: str  # sha1 of the targets' source at TESTED (`fingerprint`)


PATCHES = {
    "no_second_reduction": Patch(
        ("reduce_nothing_in_apply",),
        (f"{_OPT}._backend_update_step", f"{_OPT}._all_reduce_sum_gradients"),
        "keras-team/keras#19308 (open: Keras 3 dropped tf.keras's skip_gradients_aggregation; "
        "its TF optimizer always sums the gradients in apply)",
        "tfdist's training step reduces the gradients itself; Keras's apply would all-reduce "
        "them a second time under a tf.distribute strategy (N replicas: N times the gradient)",
        "tests/test_strategies.py::test_mirrored_on_2_logical_cpus_matches_single_step_for_step",
        "835f108ef081"),
    "gradient_reduction": Patch(
        ("set_gradient_reduction",),
        (f"{_OPT}._backend_update_step", f"{_OPT}._all_reduce_sum_gradients",
         "keras.src.optimizers.base_optimizer:BaseOptimizer._backend_apply_gradients"),
        "tensorflow/tensorflow#33929 and horovod/horovod#1346 (open: clipping before the "
        "all-reduce); duplicate sparse rows: none found (tf.keras's "
        "_deduplicate_indexed_slices is gone from Keras 3)",
        "a user's Keras 3 optimizer under a strategy: global_clipnorm clips each replica's partial "
        "gradient, and Adam squares duplicate IndexedSlices one by one",
        "tests/test_strategies.py::test_optimizer_corrections_make_mirrored_equal_single",
        "6ba939acea68"),
    "symbolic_build_under_mwms": Patch(
        ("fix_fit_under_multi_worker", "_maybe_symbolic_build"),
        (f"{_K}._maybe_symbolic_build",),
        "keras-team/keras#20585",
        "TensorFlowTrainer._maybe_symbolic_build reduces the first PerReplica batch and fails "
        "under MultiWorkerMirroredStrategy ('Attempt to convert a value (PerReplica...')",
        "tests/test_multi_worker.py::test_each_keras_correction_is_needed[1]", "abb81c290f51"),
    "reduce_per_replica_under_mwms": Patch(
        ("fix_fit_under_multi_worker", "_reduce_per_replica"),
        ("keras.src.backend.tensorflow.trainer:reduce_per_replica",),
        "keras-team/keras#20585",
        "reduce_per_replica(..., 'mean') under MultiWorkerMirrored fails on the scalar loss "
        "(axis 0) or reports worker 0's loss only",
        "tests/test_multi_worker.py::test_each_keras_correction_is_needed[2]", "1def5ef1659f"),
    "keras_methods_follow_the_strategy": Patch(
        ("route_keras", "keras_method", "_bind"),
        ("keras.src.trainers.trainer:Trainer.compile", f"{_K}.fit", f"{_K}.evaluate",
         f"{_K}.predict", "keras.src.models.model:Model.save"),
        "keras-team/keras#18624 (no ParameterServerStrategy path in fit); Keras 3 has no hook "
        "for a strategy that is not a tf.distribute one (Horovod)",
        "a user's compile/fit/evaluate/predict/save under tfdist's strategies: gradient "
        "all-reduce without wrap_optimizer, split input, the parameter server's coordinator",
        "tests/test_keras_programs.py::test_without_routing_horovod_ranks_read_whole_batches",
        "3ca7514a8954"),
    "loss_tracker": Patch(
        ("track_loss", "train_step_loss", "train_step_losses", "test_step_given"),
        (f"{_K}.train_step", f"{_K}.test_step", "keras.src.trainers.trainer:Trainer._compute_loss",
         "keras.src.losses.loss:unscale_loss_for_distribution"),
        "none found: a train_step of one's own has no public way to update the `loss` metric "
        "as Keras's does (its tracker is private; keras-team/keras#20610 made Keras's own "
        "unscale it, with a private function)",
        "tfdist's step and the parameter server's closures would log no loss, or a mean mixing "
        "steps and resets",
        "tests/test_pipeline.py::test_losses_over_ten_steps_equal_the_unsplit_model",
        "cedc6323e135"),
    "train_function_per_batch": Patch(
        ("train_function_per_batch",),
        (f"{_K}._make_function", f"{_K}.make_train_function"),
        "keras-team/keras#20582 (open: Keras's own gradient accumulation updates inside a cond, "
        "where MirroredStrategy's merge_call cannot run); Keras has no public way to run a "
        "different step function for some batches",
        "gradient accumulation under mirrored, multi_worker_mirrored and the Keras programs that "
        "tfdist steps would be refused: the update and its collective would sit in a cond",
        "tests/test_accumulation.py::test_accumulation_equals_one_larger_batch",
        "659b9844eb05"),
    "update_on_variable_device": Patch(
        ("update_on_variable_device",),
        (f"{_OPT}._distributed_tf_update_step",),
        "none found: Keras 3 (TF backend, default strategy) leaves the optimizer's update math "
        "without a device",
        "a pipeline's updates would all run on its first device",
        "tests/test_pipeline.py::test_every_stage_is_on_its_device", "b6ad55ddf44b"),
    "learning_rate_schedule": Patch(
        ("learning_rate_schedule", "set_learning_rate_schedule"),
        ("keras.src.optimizers.base_optimizer:BaseOptimizer.__init__",
         "keras.src.optimizers.base_optimizer:BaseOptimizer._get_current_learning_rate"),
        "none found: Keras 3 exposes a schedule only through optimizer._learning_rate "
        "(optimizer.learning_rate is the current value)",
        "Horovod's linear learning-rate scaling could not wrap the schedule, warmup included",
        "tests/test_horovod.py::test_learning_rate_scaling_keeps_the_warmup", "b950aca13f8b"),
    "optimizer_strategy": Patch(
        ("optimizer_strategy",),
        (f"{_OPT}.__init__",),
        "none found: no public way to ask which tf.distribute strategy an optimizer belongs to "
        "(TF: 'Mixing different tf.distribute.Strategy objects'; related: keras-team/keras#17187)",
        "an optimizer a user built outside strategy.scope() would fail at its first step",
        "tests/test_keras_programs.py::"
        "test_an_optimizer_built_outside_the_scope_is_rebuilt_or_refused", "54b71302e6e7"),
    "local_variables": Patch(
        ("local_variables",),
        ("tensorflow.python.distribute.numpy_dataset:SingleDevice",
         "tensorflow.python.distribute.mirrored_strategy:MirroredExtended._create_variable"),
        "tensorflow/tensorflow#42701 (closed: no public way to make a variable that is not "
        "mirrored in a MirroredStrategy's scope); TF skips mirroring only for "
        "colocate_with=numpy_dataset.SingleDevice",
        "ZeRO's per-worker slot shards under multi_worker_mirrored would be broadcast from "
        "worker 0 (every worker then updates with worker 0's moments)",
        "tests/test_zero.py::test_zero_under_multi_worker_mirrored_equals_plain_data_parallel",
        "37a79ae46d67"),
    "symbolic_build": Patch(
        ("build_for",),
        ("keras.src.trainers.trainer:Trainer._symbolic_build",),
        "none found: no public way to build a model, its compiled loss and metrics and its "
        "optimizer from a dataset's specs, as fit does",
        "under Horovod and the parameter server a subclassed model would have no variables to "
        "broadcast (or create on the ps) before its first step",
        "tests/test_keras_programs.py::test_the_same_program_under_every_strategy", "904fa3a44e90"),
    "adam_slots": Patch(
        ("adam_slots",),
        ("keras.src.optimizers.adam:Adam.update_step",
         "keras.src.optimizers.base_optimizer:BaseOptimizer._get_variable_index"),
        "none found (related: keras-team/keras#19992, Keras 3's optimizers dropped tf.keras 2's "
        "fused raw ops): Keras 3 keeps Adam's moments in private lists",
        "tfdist's AdamW (tfdist.optimizers) could not update a variable in one op and would run "
        "Keras's dozen ops per variable",
        "tests/test_fast_step.py::test_adamw_updates_each_variable_in_one_op_as_keras_would",
        "3ec6bc5c68c9"),
    "metrics_order": Patch(
        ("flatten_metrics",),
        ("keras.src.trainers.trainer:Trainer._flatten_metrics_in_order",),
        "none found: evaluate(return_dict=False)'s order is private",
        "evaluate under Horovod and the parameter server would return its metrics in another "
        "order than Keras's",
        "tests/test_keras_programs.py::test_the_same_program_under_every_strategy", "5eb75be05e9e"),
    "backup_paths": Patch(
        ("redirect_backup", "take_initial_epoch"),
        ("keras.src.callbacks.backup_and_restore:BackupAndRestore.__init__",
         "keras.src.callbacks.backup_and_restore:BackupAndRestore._load_model"),
        "none found for its paths (Keras 3's BackupAndRestore has no chief/worker logic); the "
        "epoch it restores is left in model._initial_epoch, which fit reads "
        "(keras-team/keras#19179)",
        "a user's BackupAndRestore on a worker that is not the chief would race the chief's "
        "files; under the parameter server the restored epoch would be ignored",
        "tests/test_keras_programs.py::test_keras_backup_and_restore_resumes_every_process",
        "dcf596057796"),
    "replace_sublayer": Patch(
        ("replace_sublayer",),
        ("keras.src.utils.tracking:Tracker.untrack",),
        "keras-team/keras#18601 (open: allow sublayer reassignment)",
        "a tensor-parallel GPT would keep the unsplit Dense layers as well (their variables "
        "unused but saved)",
        "tests/test_tensor_parallel.py::test_gradients_equal_the_unsplit_model", "cc1b2a5c1fd7"),
    "trackable_tensors": Patch(
        ("Tensors",),
        ("tensorflow.python.trackable.base:Trackable._serialize_to_tensors",
         "tensorflow.python.trackable.base:Trackable._restore_from_tensors"),
        "none found: tf.train.Checkpoint saves an object as tensors of its own only through "
        "Trackable's private protocol (tf.__internal__.tracking.Trackable)",
        "a tensor-parallel layer's shards would be saved as shards: a backup could not restore "
        "into another number of shards",
        "tests/test_tensor_parallel.py::"
        "test_a_backup_of_two_shards_restores_into_one_and_into_two_stages_of_two", "26c2b69e0a68"),
    "pending_closures": Patch(
        ("pending_closures",),
        ("tensorflow.python.distribute.coordinator.cluster_coordinator:"
         "_CoordinatedClosureQueue.__init__",
         "tensorflow.python.distribute.coordinator.cluster_coordinator:Cluster.__init__"),
        "none found: tf.distribute.coordinator.ClusterCoordinator has no public queue length",
        "polling a step counter on the ps instead costs the ps and the chief about a quarter "
        "core each",
        "tests/test_parameter_server.py::test_a_paused_worker_does_not_stop_the_other",
        "2260062c9d7d"),
    "xspace": Patch(
        ("xspace",),
        ("tensorflow.tsl.profiler.protobuf.xplane_pb2",),
        "tensorflow/tensorflow#60060 (closed: no public reader of the profiler's xplane.pb; "
        "TensorBoard's profile plugin parses it with the same generated module)",
        "tfdist.runtime.profiling could not read a profiled step (the overlap of the all-reduce)",
        "tests/test_buckets.py::test_overlap_is_read_from_the_order_of_the_trace", "103506923aba"),
    "slurm_tasks_per_node": Patch(
        ("slurm_tasks_per_node",),
        ("tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver:"
         "expand_tasks_per_node",),
        "none found: TF's SlurmClusterResolver keeps its SLURM_TASKS_PER_NODE parser private",
        "task counts such as '2(x3),1' would be read otherwise than TF's resolver reads them",
        "tests/test_cluster.py::test_slurm_environment_builds_the_cluster", "880b0270c455"),
    "parameter_storage": Patch(
        ("storage", "has_storage", "release_storage", "restore_storage"),
        ("keras.src.backend.tensorflow.core:Variable._initialize",
         "keras.src.backend.common.variables:Variable"),
        "keras-team/keras#18473 (open: Keras's sharded variables, keras.distribution, run on JAX "
        "only; the TF backend has no way to hold a variable's value elsewhere)",
        "ZeRO-3 could not shard the weights: every replica would hold all of them",
        "tests/test_zero3.py::test_each_replica_holds_one_nth_of_the_weights", "0203941a8bfd"),
    "staged_storage": Patch(
        ("make_stageable", "fill_storage", "empty_storage"),
        ("keras.src.backend.tensorflow.core:Variable._initialize",
         "keras.src.backend.common.variables:Variable"),
        "keras-team/keras#18473 (open: the TF backend has no way to hold a variable's value "
        "elsewhere, so none to bring a value in for one update and out again)",
        "ZeRO-Offload's step would hold every optimizer slot in memory",
        "tests/test_offload.py::test_a_subgroup_holds_values_only_while_it_is_updated",
        "0203941a8bfd"),
    "weight_decay_choice": Patch(
        ("uses_weight_decay",),
        ("keras.src.optimizers.base_optimizer:BaseOptimizer._use_weight_decay",),
        "none found: Keras 3 keeps which variables `exclude_from_weight_decay` excludes in private "
        "attributes and has no public query",
        "ZeRO-Offload's sub-group optimizers would decay the biases and norms that the run's "
        "optimizer excludes",
        "tests/test_offload.py::test_offload_keeps_the_weight_decay_exclusions",
        "5176588e0ea0"),
    "runtime_started": Patch(
        ("tf_runtime_started",),
        ("tensorflow.python.eager.context:Context.ensure_initialized",),
        "none found: TF has no public way to ask whether its runtime has started (tf.config's "
        "setters raise only when asked to change something once it has)",
        "tfdist launch's warm agent could fork a worker from a process whose TF runtime had "
        "started (its thread pools' locks held by threads the fork does not have)",
        "tests/test_warm.py::test_a_process_whose_runtime_started_forks_no_worker",
        "ef0bea55722a"),
    "coordination_heartbeat": Patch(
        ("configure_heartbeats",),
        ("tensorflow.python.distribute.collective_all_reduce_strategy:"
         "CollectiveAllReduceExtended._initialize_multi_worker",
         "tensorflow.python.eager.context:Context.configure_coordination_service"),
        "none found: MultiWorkerMirroredStrategy configures TF's coordination service with its "
        "default heartbeat timeout (10 s) and takes no option for it",
        "on a slow link a heartbeat waits behind a bucket of gradients longer than 10 s and the "
        "service aborts a healthy group (10 Mbit/s, the hierarchy: exit 69)",
        "tests/test_multi_worker.py::test_the_heartbeat_timeout_reaches_tfs_coordination_service",
        "b5c15031701f"),
    "mesh_backend": Patch(
        ("install_mesh_backend",),
        ("keras.src.backend.tensorflow.distribution_lib",
         "keras.src.distribution.distribution_lib:list_devices",
         "keras.src.distribution.distribution_lib:Distribution.__init__"),
        "keras-team/keras#18983 (the ModelParallel example fails on TF in num_processes); the "
        "TF backend's distribution_lib is headed '!!!DO NOT USE!!! This is just a prototype'",
        "keras.distribution on TF: no num_processes, process_id or distribute_tensor, and "
        "list_devices names a second process's devices as the first's",
        "tests/test_mesh.py::test_llama_on_two_processes_equals_one_device",
        "4b6f14b78305"),
    "mesh_variables": Patch(
        ("install_mesh_variables", "current_distribution", "_model_on_mesh"),
        ("keras.src.backend.tensorflow.core:Variable",
         "keras.src.backend.common.variables:Variable.__init__"),
        "keras-team/keras#18473 (open: variables are laid out on JAX only); keras-io's "
        "distribution guide: TensorFlow support 'is currently in development'",
        "under ModelParallel on TF every variable is a whole tf.Variable on CPU:0, without a "
        "word, and fit gives one device's losses",
        "tests/test_mesh.py::test_llama_on_a_mesh_equals_one_device",
        "fa54528cf16a"),
    "mesh_trainer": Patch(
        ("install_mesh_trainer", "symbolic_build"),
        (f"{_K}.make_train_function", f"{_K}.make_test_function",
         f"{_K}.make_predict_function", f"{_K}._make_function",
         "keras.src.trainers.trainer:Trainer._symbolic_build"),
        "none found: Keras's TF trainer reads its batches inside a tf.function, which DTensor "
        "cannot lay out, and runs the step in one function, where DTensor (TF 2.21) loses the "
        "order of a variable's write and a later read",
        "fit on a mesh fails ('Could not find tf._element_layouts'), or with batches laid out "
        "Adam reads its moments as zero and no weight moves",
        "tests/test_mesh.py::test_llama_on_a_mesh_equals_one_device",
        "bd8983a2aeb7"),
    "mesh_slice_update": Patch(
        ("install_mesh_slice_update",),
        ("keras.src.backend.tensorflow.core:slice_update",),
        "none found: DTensor has no layout propagation for XlaDynamicUpdateSlice ('Please file "
        "a feature request to TF DTensor', TF 2.21)",
        "keras-hub's generate on a mesh fails at its KV cache's update",
        "tests/test_mesh.py::test_llama_on_a_mesh_equals_one_device",
        "c82d674898f6"),
    "mesh_generate": Patch(
        ("install_mesh_generate",),
        ("keras_hub.src.models.causal_lm:CausalLM.make_generate_function",
         "keras_hub.src.models.causal_lm:CausalLM._normalize_generate_outputs"),
        "none found: keras-hub's generate passes numpy prompts to its generate function and "
        "concatenates the outputs as numpy",
        "generate on a mesh fails when it gathers its outputs (a DTensor sharded over the "
        "batch axis has no numpy value)",
        "tests/test_mesh.py::test_llama_on_a_mesh_equals_one_device",
        "25e0d6af3032"),
    "mesh_saving": Patch(
        ("install_mesh_saving",),
        ("keras.src.models.model:Model.save", "keras.src.models.model:Model.save_weights"),
        "none found: Keras's save writes the file from every process (on JAX too)",
        "on a mesh of several processes, reading the variables is a collective: a save by the "
        "chief alone hangs, and a save by all writes one file from each (the backup of a killed "
        "group could not be loaded: 'A total of 20 objects could not be loaded')",
        "tests/test_mesh.py::test_a_killed_worker_resumes_at_its_backup",
        "9dd3cc517045"),
    "mesh_backups": Patch(
        ("install_mesh_backups",),
        ("keras.src.callbacks.backup_and_restore:BackupAndRestore.on_train_begin",
         "keras.src.callbacks.backup_and_restore:BackupAndRestore.on_train_end"),
        "none found: Keras's BackupAndRestore writes, copies and removes its files from every "
        "process",
        "on a mesh of two processes the second removed the backup directory at the end while "
        "the first still wrote its last backup (FileNotFoundError)",
        "tests/test_mesh.py::test_a_killed_worker_resumes_at_its_backup",
        "818c514a5941"),
    "horovod_built_check": Patch(
        ("horovod_built", "patch_horovodrun"),
        ("horovod.common.util:_check_extension_lambda", "horovod.runner.launch:check_build"),
        "none found: horovodrun learns how Horovod was built (gloo_built, mpi_built, ...) by "
        "importing horovod.tensorflow, and with it all of TensorFlow, in a forked process, "
        "once per question",
        "every horovodrun costs a fresh TensorFlow import (2-3 s of CPU here) before any rank "
        "starts; the suite ran 61 of them",
        "tests/test_horovod.py::test_horovodrun_answers_its_build_check_without_tensorflow",
        "045ba8252005"),
}


def source_link(target):
    """The upstream source file of `target` at the tested versions, as a URL."""
    module = target.partition(":")[0]
    if module.startswith("horovod."):
        return (f"https://github.com/horovod/horovod/blob/v{TESTED_HOROVOD}/"
                f"{module.replace('.', '/')}.py")
    if module.startswith("keras."):
        return (f"https://github.com/keras-team/keras/blob/v{TESTED['keras']}/"
                f"{module.replace('.', '/')}.py")
    if module.endswith("_pb2"):  # generated from its .proto, in TF's tree under third_party/xla
        path = "third_party/xla/xla/" + module.split("tensorflow.", 1)[1].replace(".", "/")
        return (f"https://github.com/tensorflow/tensorflow/blob/v{TESTED['tensorflow']}/"
                f"{path[:-len('_pb2')]}.proto")
    return (f"https://github.com/tensorflow/tensorflow/blob/v{TESTED['tensorflow']}/"
            f"{module.replace('.', '/')}.py")


def markdown():
    """The table as docs/upstream.md shows it (tests/test_compat.py keeps the two equal)."""
    import re
    issue = lambda text: re.sub(  # noqa: E731
        r"\b([\w-]+/[\w-]+)#(\d+)", r"[\1#\2](https://github.com/\1/issues/\2)", text)
    rows = ["| row | tfdist.compat | relies on (tested: "
            + ", ".join(f"{k} {v}" for k, v in TESTED.items()) + ") | upstream issue | "
            "without it | the test that fails without it |", "|---|---|---|---|---|---|"]
    for name, p in PATCHES.items():
        targets = "<br>".join(f"[`{t.partition(':')[2] or t.rpartition('.')[2]}`]"
                              f"({source_link(t)})" for t in p.targets)
        rows.append(f"| <a id=\"{name}\"></a>`{name}` | "
                    + ", ".join(f"`{f}`" for f in p.functions) + f" | {targets} | "
                    f"{issue(p.issue)} | {p.breaks} | `{p.test}` |")
    return "\n".join(rows) + "\n"


def fingerprint(targets):
    """sha1 (12 hex digits) of the source of `targets` ("module:qualified.name", or a module);
    "missing" when one cannot be found."""
    h = hashlib.sha1()
    for target in targets:
        module, _, name = target.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in filter(None, name.split(".")):
                obj = getattr(obj, part)
            h.update(inspect.getsource(obj).encode())
        except (ImportError, AttributeError, OSError, TypeError):
            return "missing"
    return h.hexdigest()[:12]


def horovod_row(name):
    """Whether row `name`'s targets are Horovod's (guarded by its version, not Keras's)."""
    return all(t.startswith("horovod.") for t in PATCHES[name].targets)


def installed():
    import keras
    import tensorflow as tf
    return {"keras": keras.__version__, "tensorflow": tf.__version__}


def version_line(versions, refused):
    """The one line said at start on versions other than TESTED."""
    off = ", ".join(f"{k} {versions[k]} (tfdist is tested with {v})" for k, v in TESTED.items()
                    if versions[k] != v)
    return (f"tfdist: warning: {off}: " + (
        f"the upstream code of patch(es) {', '.join(refused)} changed, so they are refused "
        f"(a run that needs one stops); see docs/upstream.md" if refused else
        "the upstream code of every patch is unchanged, so they apply"))


#: Rows switched off (a test's hook: TFDIST_DISABLE_PATCHES, `disable`).
disabled = set(filter(None, os.environ.get("TFDIST_DISABLE_PATCHES", "").split(",")))
#: Rows whose targets changed on the installed versions.
refused = set()


def disable(*names):
    unknown = set(names) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown patch(es) {sorted(unknown)}; known: {sorted(PATCHES)}")
    disabled.update(names)


def using(name):
    """Whether row `name` applies: False when switched off; a one-line UsageError when its
    target changed on these versions (never applied on code it was not written for)."""
    if name not in PATCHES:
        raise ValueError(f"unknown patch {name!r}")
    if horovod_row(name):
        _guard_horovod()
    else:
        guard()
    if name in refused:
        raise UsageError(f"tfdist's patch {name} relies on upstream code that changed in the "
                         f"installed {', '.join(f'{k} {v}' for k, v in installed().items())} "
                         f"(tested with {', '.join(f'{k} {v}' for k, v in TESTED.items())}): "
                         f"install those, or see docs/upstream.md#{name}")
    return name not in disabled


_guarded = {"keras_tensorflow": False, "hvd": False}  # whose versions were checked


def guard():
    """The version guard of the Keras and TensorFlow rows, once (at the first use of one)."""
    if not _guarded["keras_tensorflow"]:
        _guarded["keras_tensorflow"] = True
        _guard()


def _guard():
    versions = installed()
    if versions == TESTED:
        return
    refused.update(name for name, p in PATCHES.items()
                   if not horovod_row(name) and fingerprint(p.targets) != p.fingerprint)
    print(version_line(versions, sorted(refused)), file=sys.stderr, flush=True)


def _guard_horovod():
    if _guarded["hvd"]:
        return
    _guarded["hvd"] = True
    import horovod
    if horovod.__version__ == TESTED_HOROVOD:
        return
    changed = [name for name, p in PATCHES.items()
               if horovod_row(name) and fingerprint(p.targets) != p.fingerprint]
    refused.update(changed)
    print(f"tfdist: warning: horovod {horovod.__version__} (tfdist is tested with "
          f"{TESTED_HOROVOD}): " + (f"the upstream code of patch(es) {', '.join(changed)} "
                                     f"changed, so they are refused; see docs/upstream.md"
                                     if changed else "the upstream code of its patches is "
                                     "unchanged, so they apply"), file=sys.stderr, flush=True)
