"""The one config object of a tfdist run, and its validation.

Every config file in `configs/` starts from `default_config()` and changes what it needs. Every bad
value, from a file or from a command-line override (`--config.model.n_layer=4`), is rejected by
`validate()` with one line naming the key and what to do.

Example:

    >>> from tfdist import config
    >>> c = config.default_config()
    >>> c.model.n_layer = 4
    >>> c = config.validate(c)
    >>> c.model.n_head = 3
    >>> config.validate(c)
    Traceback (most recent call last):
    ...
    tfdist.errors.UsageError: model.n_embd (64) must be divisible by model.n_head (3)
"""
import ml_collections

from tfdist.errors import UsageError

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
DP_HIERARCHY = ("auto", "flat", "host")  # config.dp.hierarchy (tfdist/parallel/dp/)
DP_COMPRESSION = ("none", "fp16", "bf16", "powersgd")  # config.dp.compression
DP_EXCHANGE = ("bf16", "int8", "float32")  # config.dp.exchange (the islands' deltas)
_SIGNALS = ("TERM", "USR1", "USR2", "INT", "HUP")  # what a scheduler sends before it kills


def default_config():
    """The config every run starts from: one section per concern, each key with its default
    and what it means (configs/*.py change what they need)."""
    c = ml_collections.ConfigDict()
    c.seed = 1337
    # "hf:<dir>": start from a Hugging Face checkpoint (config.json + safetensors; GPT-2 or
    # Llama): the model's shape is the checkpoint's, and its tokenizer.json the data's tokenizer
    # unless data.tokenizer is given (tfdist/models/huggingface.py). "": random weights.
    c.init_from = ""
    # "auto": tfdist chooses the layout keys (zero.stage, zero.offload, train.grad_accum_steps)
    # for this machine, its workers and train.memory_gb, says why, and writes <workdir>/layout.json
    # (tfdist/plan/auto.py); keys set away from their defaults stay as set. "": as configured.
    c.layout = ""
    c.model = _model()
    c.data = _data()
    c.train = _train()
    c.strategy = _strategy()
    c.pipeline = _pipeline()
    c.tensor = _tensor()
    c.zero = _zero()
    c.dp = _dp()
    c.backup = _backup()
    c.sample = _sample()
    return c


def _model():
    """The GPT's shape (tfdist/models/gpt.py): GPT-2's kind, or Llama's (`arch`)."""
    s = ml_collections.ConfigDict()
    s.arch = "gpt2"  # "gpt2" or "llama" (RMSNorm, rotary positions, SwiGLU, grouped queries)
    s.vocab_size = 0  # 0: the tokenizer's; larger values leave unused rows (padding)
    s.block_size = 64  # context length
    s.n_layer = 2
    s.n_head = 2
    s.n_kv_head = 0  # key/value heads (grouped-query attention); 0: n_head
    s.n_embd = 64
    s.ffn_hidden = 0  # the MLP's hidden width; 0: 4 x n_embd (gpt2), 8/3 x n_embd (llama)
    s.dropout = 0.0
    # biases in the linear layers (and LayerNorm's shift); the output head is the token
    # embedding's transpose. None: the architecture's (gpt2: both; llama: neither)
    s.bias = ml_collections.FieldReference(None, field_type=bool)
    s.tie_embeddings = ml_collections.FieldReference(None, field_type=bool)
    s.norm_eps = 1e-5
    # llama: rotary embeddings' base, and Llama 3.1's frequency scaling (factor 0: off)
    s.rope_theta = 10000.0
    s.rope_scaling_factor = 0.0
    s.rope_low_freq_factor = 1.0
    s.rope_high_freq_factor = 4.0
    s.rope_original_context = 8192
    return s


def _data():
    """The corpus, its tokenizer and its token store (tfdist/data/)."""
    s = ml_collections.ConfigDict()
    # "stdlib" (this Python's standard-library source), a comma-separated list of text files or
    # directories, "tfds:<name>[/<config>]" for a TFDS dataset already prepared in data_dir,
    # "nanogpt:<dir>" (train.bin/val.bin), or "store:<dir>" (a store from `tfdist prepare`).
    s.source = "stdlib"
    # TFDS data_dir and home of prepared stores; "" means ~/tensorflow_datasets
    s.data_dir = ""
    # "byte", "bpe" (trained on the corpus), or a tokenizer file: GPT-2 vocab.json (merges.txt
    # beside it), a Hugging Face tokenizer.json, or a SentencePiece .model.
    s.tokenizer = "byte"
    s.vocab_size = 0  # bpe: tokens to train (0: 8192); nanogpt: the ids' vocabulary (required)
    s.shard_tokens = 1 << 17  # tokens per store shard (256 KiB at uint16)
    s.text_key = "text"  # feature holding the text in a TFDS dataset
    s.val_fraction = 0.05  # tail of the corpus kept for validation (if no validation split)
    return s


def _train():
    """The optimizer, its schedule, the steps, and how TensorFlow runs them."""
    s = ml_collections.ConfigDict()
    s.batch_size = 32  # global batch, split across replicas
    s.steps = 200  # total optimizer steps (batches)
    s.steps_per_epoch = 100  # validation and a backup at each epoch end
    s.learning_rate = 1e-3
    s.min_learning_rate = 1e-4
    s.warmup_steps = 20
    s.weight_decay = 0.1
    s.beta1 = 0.9
    s.beta2 = 0.95
    s.grad_clip = 1.0  # global norm; 0 disables
    s.grad_accum_steps = 1
    # K > 0: an update whose loss or gradients are NaN/Inf on any replica is skipped everywhere,
    # and K in a row stop the run (tfdist/runtime/nonfinite.py); 0: off
    s.skip_nonfinite = 0
    # F > 0: a loss above F x the mean of the last spike_window steps, spike_steps steps in a row,
    # rolls the run back to the backup before it and moves the data order on by spike_skip
    # batches (tfdist/callbacks/spike.py); 0: off
    s.spike = 0.0
    s.spike_steps = 2
    s.spike_window = 20
    s.spike_skip = 100
    s.precision = "float32"
    # GiB a process may hold on its host (config.layout=auto fits the layout in it); 0: this
    # host's available memory shared by its processes
    s.memory_gb = 0.0
    s.jit_compile = False
    s.eval_steps = 10  # validation batches per evaluation
    s.deterministic = False  # tf.config.experimental.enable_op_determinism()
    s.log_every_steps = 1
    s.steps_per_execution = 1  # training steps per host round trip (Keras compile); TPU: 32
    s.intra_op_threads = 0  # TF's thread pools per process; 0 = TF's default (all cores)
    s.inter_op_threads = 0
    # Capture a TensorBoard profile of this global step (every op's start and end, per thread)
    # in <workdir>/profile/worker-<i>; 0: none. `tfdist.runtime.profiling` reads it.
    s.profile_step = 0
    return s


def _strategy():
    """The strategy's name, and every plugin's own options with their defaults: the plugins
    declare them (`options` in tfdist/strategies/<name>.py) and the registry registers them here
    when it is imported (`register_options`; every tfdist command imports it)."""
    s = ml_collections.ConfigDict()
    s.name = "single"
    for key, (default, _) in sorted(_OPTIONS["strategy"].items()):
        s[key] = default
    return s


def _pipeline():
    """Layer-split model parallelism (tfdist/models/pipeline.py): the GPT's blocks in `stages`
    contiguous stages on as many devices, each batch in `microbatches` (GPipe)."""
    s = ml_collections.ConfigDict()
    s.stages = 1  # 1 with microbatches 1: no pipeline
    s.microbatches = 1
    s.layers_per_stage = ""  # e.g. "2,4"; "" balances the blocks by compute
    s.devices = ""  # e.g. "/gpu:0,/gpu:1"; "" = the GPUs, else the CPU split in K
    s.recompute = False  # recompute each stage's activations in the backward pass
    # "gpipe": all M forwards, then all backwards (keeps M microbatches' activations per stage);
    # "1f1b": Megatron-LM's one-forward-one-backward (keeps at most K)
    s.schedule = "gpipe"
    return s


def _tensor():
    """Tensor parallelism (tfdist/models/tensor_parallel.py, Megatron-LM): each block's
    attention heads and MLP units split over `parallel` devices of this process (per pipeline
    stage)."""
    s = ml_collections.ConfigDict()
    s.parallel = 1
    s.sequence_parallel = False  # norms and residuals split along the sequence (Megatron)
    return s


def _zero():
    """ZeRO (tfdist/parallel/zero/): 1 shards the optimizer states over the data-parallel
    replicas, 2 also the gradients, 3 also the weights; 0 keeps them whole on every replica.
    `offload` (tfdist/parallel/zero/offload.py): host or disk holds each replica's optimizer
    state (stage 3: and its master weights) off the device, stepped on the CPU."""
    s = ml_collections.ConfigDict()
    s.stage = 0
    s.offload = "none"  # none, host or disk
    s.offload_dir = ""  # disk: "" means <workdir>/offload (one directory per replica in it)
    s.offload_subgroup = 1 << 25  # parameters per sub-group of the CPU step
    s.offload_prefetch = True  # read the next sub-group (unit) ahead, write the last behind
    return s


def _dp():
    """Data-parallel communication (tfdist/parallel/dp/): the route of the gradients' all-reduce
    across hosts, under multi_worker_mirrored and horovod."""
    s = ml_collections.ConfigDict()
    # host: reduce-scatter in each host, all-reduce across the hosts, all-gather in each host;
    # flat: the strategy's own ring; auto: host where there are several hosts of several workers
    s.hierarchy = "auto"
    # none; fp16 (Horovod's own: float16 on the wire, no error feedback); bf16 (each worker's
    # gradient rounded to bfloat16, half the bytes) or powersgd (a rank-r approximation of each
    # matrix), both with error feedback, under horovod and multi_worker_mirrored
    # (tfdist/parallel/dp/)
    s.compression = "none"
    s.powersgd_rank = 1  # r (PyTorch's powerSGD_hook's default)
    s.powersgd_start = 10  # updates with the plain all-reduce before PowerSGD starts (warm start)
    # Local-SGD islands (DiLoCo): groups of workers that train on their own and meet every
    # sync_every updates at the exchange (`tfdist launch --islands=N`)
    s.islands = 1
    s.sync_every = 50  # updates between two syncs (DiLoCo's H)
    s.outer_lr = 0.7  # the outer optimizer: SGD with Nesterov momentum (DiLoCo's settings)
    s.outer_momentum = 0.9
    s.exchange = "bf16"  # how the pseudo-gradients travel: bf16, int8 or float32
    s.sync_timeout = 120.0  # seconds the others wait at a sync for an island that is not there
    return s


def _backup():
    """Step-exact backups (tfdist/callbacks/backup.py) and preemption."""
    s = ml_collections.ConfigDict()
    s.enabled = True
    s.dir = ""  # "" means <workdir>/backup
    s.every_steps = 50
    s.keep = 2
    s.delete_on_success = True
    s.asynchronous = True  # written in the background while training goes on
    # In memory (tfdist/callbacks/memory.py), under tfdist launch: each process's state after
    # every memory_every_steps steps in its host's keeper (0: none), and a ZeRO shard's copy in
    # a peer host's keeper every peer_every_steps. A restarted group takes its state from
    # there (a lost host's too: a spare's), and the disk backup remains for the rest.
    s.memory_every_steps = 1
    s.peer_every_steps = 1
    # Preemption (tfdist/runtime/preemption.py): on these signals the run finishes its step,
    # writes a backup within grace_secs and exits with status 75 ("resume me").
    s.preemption_signals = "TERM,USR1"
    s.grace_secs = 30.0
    return s


def _sample():
    """What `tfdist sample` generates by default."""
    s = ml_collections.ConfigDict()
    s.prompt = "def "
    s.max_new_tokens = 200
    s.temperature = 0.8
    s.top_k = 40
    return s


#: Options a higher layer registers in a section: section -> {key: (default, {owner: (check,
#: what is valid)})}. The strategy registry registers each plugin's (`tfdist.strategies`).
_OPTIONS = {"strategy": {}}


def register_options(section, options, owner):
    """Adds `owner`'s `options` ({key: (default, check(value) -> bool, what is valid)}) to
    `section` of the config every later `default_config()` makes, checked by `validate()`. A key
    registered by two owners (plugins sharing an option) must have one default."""
    known = _OPTIONS[section]
    for key, (default, check, what) in options.items():
        if key in known and known[key][0] != default:
            raise ValueError(f"config option {section}.{key}: {owner} gives it the default "
                             f"{default!r}, another owner gave {known[key][0]!r}")
        known.setdefault(key, (default, {}))[1][owner] = (check, what)


def _positive_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _non_negative_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# key -> (check, what a valid value is)
_RULES = {
    "seed": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "model.vocab_size": (lambda v: isinstance(v, int) and v >= 0,
                         "0 (the tokenizer's) or an integer >= the tokenizer's vocabulary"),
    "data.tokenizer": (lambda v: bool(v.strip()), "byte, bpe, or a tokenizer file"),
    "data.vocab_size": (lambda v: isinstance(v, int) and (v == 0 or 2 <= v <= 1 << 31),
                        "0 or an integer in [2, 2**31]"),
    "data.shard_tokens": (lambda v: isinstance(v, int) and 1024 <= v <= 1 << 28,
                          "an integer in [1024, 2**28]"),
    "model.block_size": (_positive_int, "an integer > 0"),
    "model.n_layer": (_positive_int, "an integer > 0"),
    "model.n_head": (_positive_int, "an integer > 0"),
    "model.arch": (lambda v: v in ("gpt2", "llama"), "gpt2 or llama"),
    "model.n_kv_head": (_non_negative_int, "an integer >= 0 (0: model.n_head)"),
    "model.ffn_hidden": (_non_negative_int, "an integer >= 0 (0: the architecture's default)"),
    "model.norm_eps": (lambda v: 0 < v < 1, "a number in (0, 1)"),
    "model.rope_theta": (lambda v: v > 1, "a number > 1"),
    "model.rope_scaling_factor": (lambda v: v == 0 or v >= 1, "0 (off) or a factor >= 1"),
    "model.rope_original_context": (_positive_int, "an integer > 0"),
    "init_from": (lambda v: v == "" or v.startswith("hf:"), "\"\" or hf:<checkpoint directory>"),
    "layout": (lambda v: v in ("", "auto"), "\"\" (as configured) or auto"),
    "train.memory_gb": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                        and v >= 0, "a number of GiB >= 0 (0: this host's memory)"),
    "model.n_embd": (_positive_int, "an integer > 0"),
    "model.dropout": (lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
    "data.source": (lambda v: bool(v.strip()), "'stdlib', paths, 'tfds:<name>', 'nanogpt:<dir>' "
                                               "or 'store:<dir>'"),
    "data.val_fraction": (lambda v: 0.0 < v < 0.5, "a number in (0, 0.5)"),
    "train.batch_size": (_positive_int, "an integer > 0"),
    "train.steps": (_positive_int, "an integer > 0"),
    "train.steps_per_epoch": (_positive_int, "an integer > 0"),
    "train.learning_rate": (lambda v: v > 0, "a number > 0"),
    "train.min_learning_rate": (lambda v: v >= 0, "a number >= 0"),
    "train.warmup_steps": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    "train.weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "train.beta1": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "train.beta2": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "train.grad_clip": (lambda v: v >= 0, "a number >= 0 (0 disables clipping)"),
    "train.grad_accum_steps": (_positive_int, "an integer > 0"),
    "train.spike": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                    and (v == 0 or v > 1), "0 (off) or a factor > 1"),
    "train.spike_steps": (_positive_int, "an integer > 0"),
    "train.spike_window": (_positive_int, "an integer > 0"),
    "train.spike_skip": (_non_negative_int, "an integer >= 0 (batches)"),
    "train.skip_nonfinite": (_non_negative_int, "0 (off) or the number K of skipped updates in "
                                                "a row that stop the run"),
    "train.precision": (lambda v: v in PRECISIONS, "one of " + ", ".join(PRECISIONS)),
    "train.eval_steps": (_positive_int, "an integer > 0"),
    "train.log_every_steps": (_positive_int, "an integer > 0"),
    "train.intra_op_threads": (lambda v: 0 <= v <= 1024, "an integer >= 0 (0: TF's default)"),
    "train.inter_op_threads": (lambda v: 0 <= v <= 1024, "an integer >= 0 (0: TF's default)"),
    "train.profile_step": (lambda v: isinstance(v, int) and v >= 0,
                           "an integer >= 0 (a global step to profile; 0: none)"),
    "strategy.name": (lambda v: bool(v), "a strategy name"),
    "train.steps_per_execution": (_positive_int, "an integer > 0"),
    "pipeline.stages": (lambda v: isinstance(v, int) and 1 <= v <= 64, "an integer in [1, 64]"),
    "pipeline.microbatches": (lambda v: isinstance(v, int) and 1 <= v <= 4096,
                              "an integer in [1, 4096]"),
    "pipeline.layers_per_stage": (
        lambda v: v == "" or all(p.strip().isdigit() for p in v.split(",")),
        "comma-separated block counts, e.g. 2,4 (\"\": balanced)"),
    "pipeline.schedule": (lambda v: v in ("gpipe", "1f1b"), "gpipe or 1f1b"),
    "tensor.parallel": (lambda v: isinstance(v, int) and 1 <= v <= 64, "an integer in [1, 64]"),
    "tensor.sequence_parallel": (lambda v: isinstance(v, bool), "True or False"),
    "zero.stage": (lambda v: v in (0, 1, 2, 3), "0, 1, 2 or 3"),
    "zero.offload": (lambda v: v in ("none", "host", "disk"), "none, host or disk"),
    "zero.offload_subgroup": (lambda v: isinstance(v, int) and v >= 1 << 10,
                              "an integer >= 1024 (parameters per sub-group)"),
    "backup.every_steps": (lambda v: isinstance(v, int) and v >= 0,
                           "an integer >= 0 (0: epoch ends only)"),
    "backup.keep": (_positive_int, "an integer > 0"),
    "backup.memory_every_steps": (lambda v: isinstance(v, int) and v >= 0,
                                  "an integer >= 0 (0: no snapshots in memory)"),
    "backup.peer_every_steps": (_positive_int, "an integer > 0, a multiple of "
                                               "backup.memory_every_steps"),
    "backup.asynchronous": (lambda v: isinstance(v, bool), "True or False"),
    "backup.preemption_signals": (
        lambda v: all(n.strip().upper() in _SIGNALS for n in v.split(",") if n.strip()),
        "comma-separated signal names such as TERM,USR1 (\"\": none)"),
    "backup.grace_secs": (lambda v: v > 0, "a number of seconds > 0"),
    "dp.hierarchy": (lambda v: v in DP_HIERARCHY,
                     "one of " + ", ".join(DP_HIERARCHY) + " (host: reduce-scatter in each host, "
                     "all-reduce across hosts, all-gather in each host)"),
    "dp.compression": (lambda v: v in DP_COMPRESSION,
                       "one of " + ", ".join(DP_COMPRESSION) + " (the gradients' all-reduce; "
                       "fp16: Horovod's own)"),
    "dp.powersgd_rank": (_positive_int, "an integer > 0 (the rank of PowerSGD's approximation)"),
    "dp.islands": (_positive_int, "an integer > 0 (1: no islands)"),
    "dp.sync_every": (_positive_int, "an integer > 0 (updates between the islands' syncs)"),
    "dp.outer_lr": (lambda v: v > 0, "a number > 0 (the islands' outer learning rate)"),
    "dp.outer_momentum": (lambda v: 0 <= v < 1, "a number in [0, 1) (the outer Nesterov "
                                                 "momentum)"),
    "dp.exchange": (lambda v: v in DP_EXCHANGE,
                    "one of " + ", ".join(DP_EXCHANGE) + " (how the islands' deltas travel)"),
    "dp.sync_timeout": (lambda v: v > 0, "a number of seconds > 0"),
    "dp.powersgd_start": (_non_negative_int,
                          "an integer >= 0 (updates with the plain all-reduce first)"),
    "sample.max_new_tokens": (_positive_int, "an integer > 0"),
    "sample.temperature": (lambda v: v > 0, "a number > 0"),
    "sample.top_k": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: no top-k)"),
}


def check_value(path, value):
    """UsageError, one line, if `value` breaks the rule of config key `path` ("dp.hierarchy")."""
    check, what = _RULES[path]
    if not _holds(check, value):
        raise UsageError(f"config key '{path}' must be {what}, got {value!r}")


def _walk(reference, given, prefix=""):
    """Reject keys the default config does not have and values of the wrong type."""
    for key in given.keys():
        path = prefix + key
        if key not in reference:
            known = ", ".join(sorted(reference.keys()))
            raise UsageError(f"unknown config key '{path}' (known keys here: {known})")
        ref, val = reference[key], given[key]
        if ref is None:  # (a typed FieldReference left unset: its type is checked on override)
            continue
        if isinstance(ref, ml_collections.ConfigDict):
            if not isinstance(val, (ml_collections.ConfigDict, dict)):
                raise UsageError(f"config key '{path}' must be a section, got {val!r}")
            _walk(ref, ml_collections.ConfigDict(val) if isinstance(val, dict) else val, path + ".")
            continue
        ok_types = (int, float) if isinstance(ref, float) else (type(ref),)
        if isinstance(val, bool) != isinstance(ref, bool) or not isinstance(val, ok_types):
            raise UsageError(f"config key '{path}' must be {type(ref).__name__}, got {val!r} "
                             f"({type(val).__name__})")


def validate(c):
    """Checks `c` against the schema of `default_config()`; raises UsageError on the first
    problem."""
    _walk(default_config(), c)
    resolve_architecture(c.model)
    for path in _RULES:
        section, _, key = path.rpartition(".")
        check_value(path, c[section][key] if section else c[key])
    _check_options(c)
    m, t = c.model, c.train
    if m.n_embd % m.n_head:
        raise UsageError(f"model.n_embd ({m.n_embd}) must be divisible by "
                         f"model.n_head ({m.n_head})")
    if m.n_kv_head and m.n_head % m.n_kv_head:
        raise UsageError(f"model.n_kv_head ({m.n_kv_head}) must divide model.n_head "
                         f"({m.n_head}): each key/value head serves a whole group of query heads")
    if m.arch == "gpt2" and m.n_kv_head not in (0, m.n_head):
        raise UsageError(f"model.n_kv_head ({m.n_kv_head}) groups the heads of arch=llama; GPT-2 "
                         f"has one key/value head per query head: set it to 0, or "
                         f"model.arch=llama")
    if m.arch == "llama" and (m.n_embd // m.n_head) % 2:
        raise UsageError(f"model.arch=llama rotates pairs of dimensions: the head width "
                         f"n_embd / n_head ({m.n_embd // m.n_head}) must be even")
    if c.zero.offload != "none" and not c.zero.stage:
        raise UsageError(f"zero.offload={c.zero.offload} needs ZeRO: set zero.stage to 1 or 2 "
                         f"(the optimizer state off the device) or 3 (also the weights), under "
                         f"horovod or multi_worker_mirrored")
    b = c.backup
    if b.memory_every_steps and b.peer_every_steps % b.memory_every_steps:
        raise UsageError(f"backup.peer_every_steps ({b.peer_every_steps}) must be a multiple of "
                         f"backup.memory_every_steps ({b.memory_every_steps}): a peer's copy is "
                         f"one of the snapshots")
    if t.min_learning_rate > t.learning_rate:
        raise UsageError("train.min_learning_rate must not exceed train.learning_rate")
    if t.warmup_steps >= t.steps:
        raise UsageError(f"train.warmup_steps ({t.warmup_steps}) must be less than "
                         f"train.steps ({t.steps})")
    if t.steps_per_epoch % t.steps_per_execution:
        raise UsageError(f"train.steps_per_execution ({t.steps_per_execution}) must divide "
                         f"train.steps_per_epoch ({t.steps_per_epoch})")
    if t.profile_step > t.steps:
        raise UsageError(f"train.profile_step ({t.profile_step}) is beyond train.steps "
                         f"({t.steps}); pick a step of the run, or 0 for none")
    if t.steps % t.steps_per_epoch:
        raise UsageError(f"train.steps ({t.steps}) must be a multiple of train.steps_per_epoch "
                         f"({t.steps_per_epoch})")
    if t.grad_accum_steps > 1:
        _check_accumulation(c)
    if t.skip_nonfinite:
        _check_skipping(c)
    if t.spike:
        _check_spike(c)
    return c


def resolve_architecture(model):
    """Sets the `model` keys left to the architecture (None): `bias` and `tie_embeddings`, True
    for gpt2, False for llama."""
    for key in ("bias", "tie_embeddings"):
        if model[key] is None:
            model[key] = model.arch != "llama"
    return model


def _check_spike(c):
    """A rollback goes back to a backup and moves the data order on by whole updates."""
    t = c.train
    if not c.backup.enabled or not c.backup.every_steps:
        raise UsageError(f"train.spike ({t.spike}) rolls back to a backup: set backup.enabled "
                         f"and backup.every_steps")
    if t.spike_skip % t.grad_accum_steps:
        raise UsageError(f"train.spike_skip ({t.spike_skip}) must be a multiple of "
                         f"train.grad_accum_steps ({t.grad_accum_steps}): the data order moves on "
                         f"by whole updates")


def _check_skipping(c):
    """Skipping non-finite updates chooses on the host after each batch
    (`tfdist.runtime.nonfinite`): not with several batches per call (nor under a strategy whose
    workers update on their own: `Layout.from_config`)."""
    t = c.train
    if t.steps_per_execution > 1:
        raise UsageError(f"train.steps_per_execution ({t.steps_per_execution}) runs several "
                         f"batches in one call, and train.skip_nonfinite decides after each "
                         f"update on the host; set one of them to 1")
    if t.precision == "mixed_float16":
        raise UsageError("train.skip_nonfinite with mixed_float16: its loss-scale optimizer skips "
                         "non-finite steps on its own; set train.skip_nonfinite=0")


def _check_accumulation(c):
    """Gradient accumulation's rules: an update's batches never straddle an epoch's end or a
    backup (backups fall on update boundaries, where every replica's sums are 0), and each batch
    is its own call (its step is chosen on the host: `tfdist.step.TrainStep.install`)."""
    t, k = c.train, c.train.grad_accum_steps
    if t.steps_per_epoch % k:
        raise UsageError(f"train.grad_accum_steps ({k}) must divide train.steps_per_epoch "
                         f"({t.steps_per_epoch}): an update's batches may not straddle an "
                         f"epoch's end, where its validation and backup come")
    if c.backup.enabled and c.backup.every_steps % k:
        raise UsageError(f"backup.every_steps ({c.backup.every_steps}) must be a multiple of "
                         f"train.grad_accum_steps ({k}): backups fall on update boundaries")
    if t.steps_per_execution > 1:
        raise UsageError(f"train.steps_per_execution ({t.steps_per_execution}) runs several "
                         f"batches in one call, and gradient accumulation chooses each batch's "
                         f"step on the host; set one of them to 1")


def _check_options(c):
    """The registered options of each section: by the rule of the owner the section names (its
    `name`: the strategy), the others by the rule of some owner (one that would use them)."""
    for section, options in _OPTIONS.items():
        for key, (_, rules) in options.items():
            if key not in c[section]:
                continue
            named = c[section].name
            owners = [named] if named in rules else list(rules)
            if not any(_holds(rules[o][0], c[section][key]) for o in owners):
                raise UsageError(f"config key '{section}.{key}' must be {rules[owners[0]][1]} for "
                                 f"{section} {owners[0]}, got {c[section][key]!r}")


def _holds(check, value):
    try:
        return bool(check(value))
    except TypeError:
        return False


def vocab_size(c):
    """The model's vocabulary as far as the config alone tells: model.vocab_size, else the
    tokenizer's (byte: 256; bpe: data.vocab_size or 8192; nanogpt: data.vocab_size). None when
    only the tokenizer's files know (the token store records it)."""
    if c.model.vocab_size:
        return c.model.vocab_size
    if c.data.tokenizer == "byte":
        return c.data.vocab_size if c.data.source.startswith("nanogpt:") else 256
    if c.data.tokenizer == "bpe":
        return c.data.vocab_size or 8192
    return None


def gpt2_config(n_layer, n_head, n_embd):
    """A GPT-2 family config (context 1024, vocab 50257, bf16) for real hardware."""
    c = default_config()
    c.model.update(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=1024,
                   vocab_size=50257, dropout=0.0)
    c.train.update(batch_size=512, steps=600000, steps_per_epoch=2000, learning_rate=6e-4,
                   min_learning_rate=6e-5, warmup_steps=2000, eval_steps=200,
                   precision="mixed_bfloat16")
    c.backup.every_steps = 1000
    return c


def llama3_config(n_layer, n_head, n_embd, ffn_hidden, learning_rate):
    """A Llama 3 family config (8 key/value heads, context 8192, vocab 128256, rotary base 5e5,
    no biases, an untied head; 4M-token batches for 15T tokens, bf16) for real hardware."""
    c = default_config()
    c.model.update(arch="llama", vocab_size=128256, block_size=8192, n_layer=n_layer,
                   n_head=n_head, n_kv_head=8, n_embd=n_embd, ffn_hidden=ffn_hidden,
                   dropout=0.0, bias=False, tie_embeddings=False, norm_eps=1e-5,
                   rope_theta=500000.0)
    c.train.update(batch_size=512, steps=3_578_000, steps_per_epoch=2000,
                   learning_rate=learning_rate, min_learning_rate=learning_rate / 10,
                   warmup_steps=2000, eval_steps=200,
                   precision="mixed_bfloat16")  # 3,578,000 x 512 x 8192 tokens: 15.0T
    c.backup.every_steps = 1000
    return c
