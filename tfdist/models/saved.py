"""A model to sample from or export: a run's `model.keras` and the tokenizer beside it, or a
Hugging Face checkpoint directory (`tfdist sample`, `tfdist export`).

Example:

    >>> import tempfile, os
    >>> from tfdist.models.gpt import GPT
    >>> from tfdist.models import saved
    >>> gpt = GPT(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16)
    >>> gpt.build()
    >>> path = os.path.join(tempfile.mkdtemp(), "model.keras")
    >>> gpt.save(path)
    >>> model = saved.load_model(path)
    >>> type(saved.load_tokenizer(path, model)).__name__  # no tokenizer/: bytes, for 256 ids
    'ByteTokenizer'
"""
import os


def load_model(path):
    """Loads a tfdist .keras model; UsageError if the file is missing or not a tfdist GPT."""
    import keras
    import tensorflow as tf

    from tfdist.errors import UsageError
    from tfdist.models.gpt import GPT

    if not path or not tf.io.gfile.exists(path):
        raise UsageError(f"model file '{path}' not found; pass --model=<workdir>/model.keras "
                         f"written by `tfdist train`")
    try:
        model = keras.saving.load_model(path, compile=False)
    except Exception as e:  # zip/JSON/deserialization errors: one line
        raise UsageError(f"cannot load {path} as a Keras model "
                         f"({str(e).splitlines()[0][:150]})") from None
    if not isinstance(model, GPT):
        raise UsageError(f"{path} holds a {type(model).__name__}, not a tfdist GPT")
    return model


def load_tokenizer(model_path, model):
    """The tokenizer saved beside the model (`<workdir>/tokenizer/`, written by `tfdist train`);
    bytes for an older run without one, if the model's vocabulary is the byte tokenizer's."""
    import json

    import tensorflow as tf

    from tfdist.data import tokenizer
    from tfdist.errors import UsageError

    directory = os.path.join(os.path.dirname(model_path), "tokenizer")
    config_path = os.path.join(directory, "config.json")
    if not tf.io.gfile.exists(config_path):
        if model.vocab_size == 256:
            return tokenizer.ByteTokenizer()
        raise UsageError(f"no tokenizer beside {model_path} ({config_path} is missing); "
                         f"sample from a model in the workdir `tfdist train` wrote, with its "
                         f"tokenizer/")
    with tf.io.gfile.GFile(config_path) as f:
        config = json.load(f)
    if config["kind"] == "ids":
        raise UsageError(f"the run in {os.path.dirname(model_path)} was trained on token ids "
                         f"without a tokenizer; give its data's tokenizer files in data.tokenizer")
    return tokenizer.load(directory, config)


def load_checkpoint(path, need_tokenizer):
    """A GPT and its tokenizer (None if not needed and absent) from a Hugging Face directory."""
    from tfdist.data import tokenizer
    from tfdist.errors import UsageError
    from tfdist.models import huggingface

    model, checkpoint = huggingface.load_gpt(path)
    found = checkpoint.tokenizer_file()
    if found is None and need_tokenizer:
        raise UsageError(f"the checkpoint in {checkpoint.directory} has no tokenizer.json to "
                         f"encode --prompt; give the prompt as token ids (--prompt_ids=5,17,42)")
    return model, tokenizer.from_file(found) if found else None
