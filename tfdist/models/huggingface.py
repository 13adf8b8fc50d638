"""Hugging Face checkpoints in and out: GPT-2 (`GPT2LMHeadModel`) and Llama (`LlamaForCausalLM`).

A checkpoint directory holds `config.json` and its weights in safetensors files (one
`model.safetensors`, or shards listed by `model.safetensors.index.json`), and often the
tokenizer's `tokenizer.json`. `Checkpoint(dir)` reads the config into tfdist's `model` keys and
each tensor on demand (safetensors maps a local file: a tensor is read when it is asked for; a
`gs://` file, read through `tf.io.gfile` as every file here is, is read whole, a file at a time);
`load_weights(model, checkpoint)` fills a built model of any layout (a GPT; a `Pipeline` of
stages and tensor-parallel shards; ZeRO-3's shards) tensor by tensor, through the layout-free
names of `tfdist.models.state`: each replica reads only the tensors it keeps (ZeRO-3: the ones
it owns), and no more than one whole tensor is held at a time. `export(gpt, dir)` writes a
directory transformers' `from_pretrained` loads.

The two layouts of the weights, Hugging Face's -> tfdist's (`tfdist.models.gpt`):

* GPT-2 stores its linear layers as `Conv1D` (input x output), as Keras's Dense kernels are:
  the tensors are copied as they are (`transformer.h.0.attn.c_attn.weight` ->
  `h_0/attn/c_attn/kernel`).
* Llama stores `nn.Linear` weights (output x input): they are transposed, the query, key and
  value projections joined into `c_attn`'s columns, and the gate and up projections into
  `c_fc`'s. Its rotary pairs are already Hugging Face's "rotate half" ones (`tfdist.models.rope`).

Example (a checkpoint written by `export` reads back with the same shape):

    >>> import tempfile
    >>> from tfdist.models.gpt import GPT
    >>> from tfdist.models import huggingface
    >>> gpt = GPT(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, arch="llama",
    ...           bias=False, tie_embeddings=False)
    >>> gpt.build()
    >>> out = tempfile.mkdtemp()
    >>> huggingface.export(gpt, out)
    >>> ckpt = huggingface.Checkpoint(out)
    >>> ckpt.architecture, ckpt.model_config()["n_embd"], ckpt.model_config()["ffn_hidden"]
    ('llama', 16, 64)
"""
import json
import os

import numpy as np

from tfdist.errors import UsageError
from tfdist.runtime.lazy import tf

#: config.json's `architectures` -> tfdist's `model.arch`
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_hf(path):
    """Whether a `--model` or `init_from` value names a Hugging Face directory ("hf:<dir>")."""
    return isinstance(path, str) and path.startswith("hf:")


def directory_of(path):
    return path[len("hf:"):] if is_hf(path) else path


class Checkpoint:
    """A Hugging Face checkpoint directory: its config as tfdist's `model` keys, its tensors by
    name (float32 numpy), its tokenizer file. UsageError (one line) for what tfdist cannot
    read."""

    def __init__(self, directory):
        self.directory = directory = directory_of(directory)
        path = os.path.join(directory, "config.json")
        if not tf.io.gfile.exists(path):
            raise UsageError(f"{directory} is not a Hugging Face checkpoint: it has no "
                             f"config.json; give the directory that transformers' "
                             f"save_pretrained wrote")
        try:
            self.config = json.loads(_read(path))
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} is not valid JSON ({e})") from None
        names = self.config.get("architectures") or [self.config.get("model_type", "?")]
        by_type = {arch: arch for arch in ARCHITECTURES.values()}  # (no `architectures`)
        known = [ARCHITECTURES.get(n, by_type.get(n)) for n in names
                 if n in ARCHITECTURES or n in by_type]
        if not known:
            raise UsageError(f"{directory} holds a {', '.join(names)}; tfdist reads "
                             f"{' and '.join(ARCHITECTURES)} checkpoints")
        self.architecture = known[0]
        self._open = {}
        self._files = self._weight_files()

    # -- config.json -> tfdist's model keys -----------------------------------------------------
    def model_config(self):
        """tfdist's `model` keys for this checkpoint (tfdist/config.py); block_size is the
        checkpoint's whole context."""
        c = self.config
        try:
            if self.architecture == "gpt2":
                return self._gpt2_config(c)
            return self._llama_config(c)
        except KeyError as e:
            raise UsageError(f"{self.directory}/config.json has no {e.args[0]!r}, which a "
                             f"{self.architecture} config needs") from None

    def _gpt2_config(self, c):
        act = c.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UsageError(f"{self.directory}: activation_function {act!r}; tfdist's GPT-2 has "
                             f"GPT-2's tanh GELU (gelu_new) only")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if c.get(flag):
                raise UsageError(f"{self.directory}: {flag}=true is not in tfdist's GPT-2")
        if not c.get("scale_attn_weights", True):
            raise UsageError(f"{self.directory}: scale_attn_weights=false is not in tfdist's "
                             f"GPT-2 (its scores are scaled by 1/sqrt(head width))")
        return {"arch": "gpt2", "vocab_size": c["vocab_size"], "block_size": c["n_positions"],
                "n_layer": c["n_layer"], "n_head": c["n_head"], "n_kv_head": 0,
                "n_embd": c["n_embd"], "ffn_hidden": c.get("n_inner") or 4 * c["n_embd"],
                "bias": True, "tie_embeddings": c.get("tie_word_embeddings", True),
                "norm_eps": c.get("layer_norm_epsilon", 1e-5), "rope_theta": 10000.0,
                "dropout": 0.0, **_no_scaling()}

    def _llama_config(self, c):
        heads, width = c["num_attention_heads"], c["hidden_size"]
        if c.get("head_dim") not in (None, width // heads):
            raise UsageError(f"{self.directory}: head_dim {c['head_dim']} is not hidden_size / "
                             f"num_attention_heads ({width // heads}), which tfdist's Llama "
                             f"assumes")
        if c.get("hidden_act", "silu") != "silu":
            raise UsageError(f"{self.directory}: hidden_act {c['hidden_act']!r}; tfdist's Llama "
                             f"has SwiGLU (silu) only")
        if c.get("attention_bias", False) != c.get("mlp_bias", False):
            raise UsageError(f"{self.directory}: attention_bias and mlp_bias differ; tfdist's "
                             f"model.bias sets both")
        rope = dict(c.get("rope_parameters") or {})
        rope.update(c.get("rope_scaling") or {})  # (transformers 4's name)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise UsageError(f"{self.directory}: rope_type {kind!r}; tfdist has the default "
                             f"rotary embeddings and Llama 3.1's scaling (llama3)")
        scaling = _no_scaling()
        if kind == "llama3":
            scaling = {"rope_scaling_factor": float(rope["factor"]),
                       "rope_low_freq_factor": float(rope["low_freq_factor"]),
                       "rope_high_freq_factor": float(rope["high_freq_factor"]),
                       "rope_original_context": int(rope["original_max_position_embeddings"])}
        return {"arch": "llama", "vocab_size": c["vocab_size"],
                "block_size": c["max_position_embeddings"], "n_layer": c["num_hidden_layers"],
                "n_head": heads, "n_kv_head": c.get("num_key_value_heads") or heads,
                "n_embd": width, "ffn_hidden": c["intermediate_size"],
                "bias": bool(c.get("attention_bias", False)),
                "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
                "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
                "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                "dropout": 0.0, **scaling}

    # -- the tensors ----------------------------------------------------------------------------
    def _weight_files(self):
        """{tensor name: file}: from the shards' index, or the one file's own list."""
        index = os.path.join(self.directory, INDEX)
        if tf.io.gfile.exists(index):
            try:
                weight_map = json.loads(_read(index))["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"{index} is not a safetensors index (JSON with a "
                                 f"weight_map)") from None
            for name in sorted(set(weight_map.values())):
                if not tf.io.gfile.exists(os.path.join(self.directory, name)):
                    raise UsageError(f"{index} lists {name}, which is missing from "
                                     f"{self.directory}")
            return weight_map
        if not tf.io.gfile.exists(os.path.join(self.directory, SINGLE)):
            raise UsageError(f"{self.directory} has no {SINGLE} nor {INDEX}; tfdist reads "
                             f"safetensors weights (save_pretrained's default)")
        self._open = {}
        return {name: SINGLE for name in self._file(SINGLE).keys()}

    def _file(self, name):
        """The safetensors file `name`, opened once: mapped where it is local (each tensor read
        when asked), else read whole through tf.io.gfile. (TF tensors: numpy has no
        bfloat16.)"""
        if name not in self._open:
            from safetensors import SafetensorError, safe_open
            from safetensors.tensorflow import load
            path = os.path.join(self.directory, name)
            try:
                if "://" in path:  # one remote file in memory at a time
                    self._open = {k: v for k, v in self._open.items() if not isinstance(v, dict)}
                    self._open[name] = load(_read(path, "rb"))
                else:
                    self._open[name] = safe_open(path, framework="tf")
            except SafetensorError as e:
                raise UsageError(f"{path} is not a readable safetensors file ({e})") from None
        return self._open[name]

    def has(self, name):
        return name in self._files

    def tensor_names(self):
        """Every tensor the checkpoint's files hold."""
        return sorted(self._files)

    def tensor(self, name):
        """The tensor `name` as float32 numpy (bfloat16 and float16 widened)."""
        if name not in self._files:
            raise UsageError(f"{self.directory} has no tensor {name}, which a "
                             f"{self.architecture} checkpoint of this config needs")
        opened = self._file(self._files[name])
        value = opened[name] if isinstance(opened, dict) else opened.get_tensor(name)
        return value.numpy().astype("float32")

    def tokenizer_file(self):
        """Its tokenizer.json, or None."""
        path = os.path.join(self.directory, "tokenizer.json")
        return path if tf.io.gfile.exists(path) else None


def _read(path, mode="r"):
    with tf.io.gfile.GFile(path, mode) as f:
        return f.read()


def _no_scaling():
    return {"rope_scaling_factor": 0.0, "rope_low_freq_factor": 1.0,
            "rope_high_freq_factor": 4.0, "rope_original_context": 8192}


# -- tfdist's names <- Hugging Face's tensors ------------------------------------------------------

def _gpt2_sources(p, n_layer, tied):
    """{tfdist name: (Hugging Face names, how to make the tensor from theirs)}; `p` the names'
    prefix ("transformer.", as GPT2LMHeadModel saves them, or "" as GPT2Model does)."""
    same = lambda t: t  # noqa: E731  (Conv1D is input x output, as a Dense kernel)
    out = {"wte/embeddings": ([f"{p}wte.weight"], same),
           "wpe/embeddings": ([f"{p}wpe.weight"], same),
           "ln_f/gamma": ([f"{p}ln_f.weight"], same), "ln_f/beta": ([f"{p}ln_f.bias"], same)}
    if not tied:
        out["lm_head/kernel"] = (["lm_head.weight"], np.transpose)
    for i in range(n_layer):
        h = f"{p}h.{i}."
        for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
            out[f"h_{i}/{ours}/gamma"] = ([f"{h}{theirs}.weight"], same)
            out[f"h_{i}/{ours}/beta"] = ([f"{h}{theirs}.bias"], same)
        for ours, theirs in (("attn/c_attn", "attn.c_attn"), ("attn/c_proj", "attn.c_proj"),
                             ("c_fc", "mlp.c_fc"), ("mlp_c_proj", "mlp.c_proj")):
            out[f"h_{i}/{ours}/kernel"] = ([f"{h}{theirs}.weight"], same)
            out[f"h_{i}/{ours}/bias"] = ([f"{h}{theirs}.bias"], same)
    return out


def _llama_sources(n_layer, tied, bias):
    joined_t = lambda *ts: np.concatenate([t.T for t in ts], axis=1)  # noqa: E731
    joined = lambda *ts: np.concatenate(ts, axis=0)  # noqa: E731  (biases)
    same = lambda t: t  # noqa: E731
    out = {"wte/embeddings": (["model.embed_tokens.weight"], same),
           "ln_f/scale": (["model.norm.weight"], same)}
    if not tied:
        out["lm_head/kernel"] = (["lm_head.weight"], np.transpose)
    for i in range(n_layer):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = [f"{a}q_proj", f"{a}k_proj", f"{a}v_proj"]
        out[f"h_{i}/ln_1/scale"] = ([f"model.layers.{i}.input_layernorm.weight"], same)
        out[f"h_{i}/ln_2/scale"] = ([f"model.layers.{i}.post_attention_layernorm.weight"], same)
        out[f"h_{i}/attn/c_attn/kernel"] = ([f"{n}.weight" for n in qkv], joined_t)
        out[f"h_{i}/attn/c_proj/kernel"] = ([f"{a}o_proj.weight"], np.transpose)
        out[f"h_{i}/c_fc/kernel"] = ([f"{m}gate_proj.weight", f"{m}up_proj.weight"], joined_t)
        out[f"h_{i}/mlp_c_proj/kernel"] = ([f"{m}down_proj.weight"], np.transpose)
        if bias:
            out[f"h_{i}/attn/c_attn/bias"] = ([f"{n}.bias" for n in qkv], joined)
            out[f"h_{i}/attn/c_proj/bias"] = ([f"{a}o_proj.bias"], same)
            out[f"h_{i}/c_fc/bias"] = ([f"{m}gate_proj.bias", f"{m}up_proj.bias"], joined)
            out[f"h_{i}/mlp_c_proj/bias"] = ([f"{m}down_proj.bias"], same)
    return out


def _sources(checkpoint, gpt):
    if gpt.arch == "gpt2":
        prefix = "transformer." if checkpoint.has("transformer.wte.weight") else ""
        return _gpt2_sources(prefix, gpt.n_layer, gpt.tie_embeddings)
    return _llama_sources(gpt.n_layer, gpt.tie_embeddings, gpt.bias)


def check_matches(checkpoint, gpt):
    """UsageError if the GPT's shape is not the checkpoint's (another architecture or size)."""
    want = checkpoint.model_config()
    for key in ("arch", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "bias",
                "tie_embeddings"):
        have = getattr(gpt, key)
        if key == "n_kv_head":
            want_kv, have = want[key] or want["n_head"], have or gpt.n_head
            if want_kv != have:
                raise UsageError(f"model.n_kv_head is {have}; the checkpoint in "
                                 f"{checkpoint.directory} has {want_kv}")
        elif want[key] != have:
            raise UsageError(f"model.{key} is {have!r}; the checkpoint in {checkpoint.directory} "
                             f"has {want[key]!r}")


def load_weights(model, checkpoint):
    """Fills the built `model` (a GPT or a Pipeline of one, any layout) with the checkpoint's
    weights, tensor by tensor. Variables this replica does not keep (ZeRO-3's other owners')
    are not read. UsageError naming the tensor whose shape differs from the model's."""
    from tfdist import compat
    from tfdist.models import state

    gpt = getattr(model, "gpt", model)
    check_matches(checkpoint, gpt)
    sources = _sources(checkpoint, gpt)
    for name, target in state.weights(model).items():
        if name not in sources:
            raise UsageError(f"tfdist's {name} has no source in a {gpt.arch} checkpoint")
        shards = getattr(target, "shards", None)
        if not any(compat.has_storage(v) for v in (shards or [target])):
            continue  # ZeRO-3: another replica owns it
        theirs, make = sources[name]
        value = make(*[checkpoint.tensor(n) for n in theirs])
        if name == "wpe/embeddings":  # a shorter context than the checkpoint's: its first rows
            value = value[:gpt.block_size]
        shape = tuple(target.shape)
        if tuple(value.shape) != shape:
            raise UsageError(f"the checkpoint's {' + '.join(theirs)} makes a tensor of shape "
                             f"{tuple(value.shape)}; tfdist's {name} is {shape} (config.json "
                             f"and the weights in {checkpoint.directory} disagree)")
        if shards is None:
            target.assign(value.astype(target.dtype))
            continue
        for shard, part in zip(shards, target.split(value)):  # tensor-parallel shards
            if compat.has_storage(shard):
                shard.assign(part)


def load_gpt(directory, block_size=None):
    """A built GPT with the checkpoint's shape and weights (to sample from; `block_size`: a
    shorter context)."""
    from tfdist import config as config_lib
    from tfdist.models.gpt import GPT

    checkpoint = Checkpoint(directory)
    c = config_lib.default_config()
    c.model.update(checkpoint.model_config())
    if block_size:
        c.model.block_size = min(block_size, c.model.block_size)
    config_lib.validate(c)  # (the shapes tfdist's rules allow: one line if not)
    gpt = GPT.from_model_config(c.model)
    gpt.build()
    load_weights(gpt, checkpoint)
    return gpt, checkpoint


# -- tfdist -> Hugging Face ---------------------------------------------------------------------

def hf_config(gpt):
    """config.json for the GPT (transformers 5's keys; rope_theta also at the top, as transformers
    4 reads it)."""
    if gpt.arch == "gpt2":
        if not gpt.bias:
            raise UsageError("a GPT-2 without biases (model.bias=False) has no transformers "
                             "GPT2LMHeadModel equivalent; export a model trained with biases")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "vocab_size": gpt.vocab_size, "n_positions": gpt.block_size,
                "n_embd": gpt.n_embd, "n_layer": gpt.n_layer, "n_head": gpt.n_head,
                "n_inner": gpt.ffn_hidden, "activation_function": "gelu_new",
                "layer_norm_epsilon": gpt.norm_eps, "resid_pdrop": gpt.dropout,
                "embd_pdrop": gpt.dropout, "attn_pdrop": gpt.dropout,
                "tie_word_embeddings": gpt.tie_embeddings, "dtype": "float32"}
    rope = {"rope_type": "default", "rope_theta": gpt.rope_theta}
    if gpt.rope_scaling:
        s = gpt.rope_scaling
        rope.update(rope_type="llama3", factor=s["factor"], low_freq_factor=s["low_freq_factor"],
                    high_freq_factor=s["high_freq_factor"],
                    original_max_position_embeddings=s["original_context"])
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": gpt.vocab_size, "hidden_size": gpt.n_embd,
            "intermediate_size": gpt.ffn_hidden, "num_hidden_layers": gpt.n_layer,
            "num_attention_heads": gpt.n_head, "num_key_value_heads": gpt.n_kv_head,
            "head_dim": gpt.n_embd // gpt.n_head, "max_position_embeddings": gpt.block_size,
            "rms_norm_eps": gpt.norm_eps, "hidden_act": "silu", "attention_bias": gpt.bias,
            "mlp_bias": gpt.bias, "attention_dropout": gpt.dropout,
            "tie_word_embeddings": gpt.tie_embeddings, "rope_theta": gpt.rope_theta,
            "rope_parameters": rope, "dtype": "float32"}


def _hf_tensors(gpt):
    """{Hugging Face name: float32 numpy} of a plain GPT's weights."""
    from tfdist.models import state

    ours = {name: np.asarray(state.value_of(v), dtype="float32")
            for name, v in state.weights(gpt).items()}
    out = {}
    if gpt.arch == "gpt2":
        for name, (theirs, _) in _gpt2_sources("transformer.", gpt.n_layer,
                                               gpt.tie_embeddings).items():
            value = ours[name]
            out[theirs[0]] = value.T if name == "lm_head/kernel" else value
        return out
    for name, (theirs, _) in _llama_sources(gpt.n_layer, gpt.tie_embeddings, gpt.bias).items():
        value = ours[name]
        if len(theirs) == 1:
            out[theirs[0]] = value.T if value.ndim == 2 and name != "wte/embeddings" else value
            continue
        widths = (gpt.blocks[0].attn.qkv_widths if "c_attn" in name
                  else (gpt.ffn_hidden, gpt.ffn_hidden))
        parts = np.split(value, np.cumsum(widths)[:-1], axis=-1)
        for n, part in zip(theirs, parts):
            out[n] = part.T if part.ndim == 2 else part
    return out


def export(gpt, directory, tokenizer_file=None):
    """Writes `gpt` (a plain, built GPT: `tfdist.models.state.plain_gpt`) as a Hugging Face
    checkpoint: config.json, model.safetensors (float32) and, if given, tokenizer.json."""
    from safetensors.numpy import save

    config = hf_config(gpt)
    tensors = {k: np.ascontiguousarray(v) for k, v in _hf_tensors(gpt).items()}
    tf.io.gfile.makedirs(directory)
    with tf.io.gfile.GFile(os.path.join(directory, SINGLE), "wb") as f:
        f.write(save(tensors, metadata={"format": "pt"}))
    with tf.io.gfile.GFile(os.path.join(directory, "config.json"), "w") as f:
        f.write(json.dumps(config, indent=2))
    if tokenizer_file:
        tf.io.gfile.copy(tokenizer_file, os.path.join(directory, "tokenizer.json"),
                         overwrite=True)


# -- a run that starts from a checkpoint (`init_from`) ---------------------------------------------

def apply_init_from(c):
    """Config `c` with its `init_from` checkpoint's shape (every `model` key but block_size, the
    training context, which must fit the checkpoint's, and dropout) and, when `data.tokenizer`
    is left at "byte", the checkpoint's tokenizer.json. Unchanged without `init_from`."""
    if not c.init_from:
        return c
    checkpoint = Checkpoint(c.init_from)
    model = checkpoint.model_config()
    if c.model.block_size > model["block_size"]:
        raise UsageError(f"model.block_size ({c.model.block_size}) is longer than the context of "
                         f"the checkpoint in {checkpoint.directory} ({model['block_size']}); "
                         f"give at most {model['block_size']}")
    for key, value in model.items():
        if key not in ("block_size", "dropout"):
            c.model[key] = value
    ids = c.data.source.startswith(("nanogpt:", "store:"))
    if c.data.tokenizer == "byte" and not ids:
        found = checkpoint.tokenizer_file()
        if found is None:
            raise UsageError(f"the checkpoint in {checkpoint.directory} has no tokenizer.json; "
                             f"give its tokenizer in data.tokenizer (a tokenizer.json, vocab.json "
                             f"or .model file) or train on token ids (data.source=nanogpt:<dir>)")
        c.data.tokenizer = found
    return c
