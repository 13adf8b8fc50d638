"""`tfdist sample`: generate text from a model saved by `tfdist train`.

    tfdist sample --model=runs/demo/model.keras --prompt='def ' --max_new_tokens=300
"""
import os
import sys

from absl import flags

from tfdist import cli

_MODEL = flags.DEFINE_string("model", None, "A .keras file written by `tfdist train`.")
_PROMPT = flags.DEFINE_string("prompt", "\n", "Text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature (> 0).",
                                  lower_bound=1e-6)
_TOP_K = flags.DEFINE_integer("top_k", 40, "Sample from the k most likely tokens (0: all).",
                              lower_bound=0)
_NUM = flags.DEFINE_integer("num_samples", 1, "How many samples.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


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


def main(argv):
    del argv
    model = load_model(_MODEL.value)
    tok = load_tokenizer(_MODEL.value, model)
    prompt = tok.encode(_PROMPT.value)
    for i in range(_NUM.value):
        out = model.generate(prompt, _MAX_NEW.value, temperature=_TEMPERATURE.value,
                             top_k=_TOP_K.value or None, seed=_SEED.value + i,
                             vocab_size=tok.vocab_size)
        print(f"--- sample {i + 1} ({os.path.basename(_MODEL.value)}) ---")
        print(tok.decode(out[0]))


def run(argv=None):
    cli.run(main, argv or sys.argv)


if __name__ == "__main__":
    run()
