"""`tfdist export`: write a model saved by `tfdist train` in another format. `--format=hf`: a
Hugging Face checkpoint directory (config.json, model.safetensors, and the run's tokenizer.json
where it has one) that transformers' `AutoModelForCausalLM.from_pretrained` loads: GPT-2's kind
as `GPT2LMHeadModel`, Llama's as `LlamaForCausalLM`.

    tfdist export --model=runs/demo/model.keras --format=hf --out=exports/demo
"""
import os
import shutil
import sys
import tempfile

from absl import flags

from tfdist import cli

_MODEL = flags.DEFINE_string("model", None, "A .keras file written by `tfdist train`.")
_FORMAT = flags.DEFINE_enum("format", "hf", ["hf"], "hf: a Hugging Face checkpoint directory.")
_OUT = flags.DEFINE_string("out", None, "The directory to write (it must not exist, or be empty, "
                           "unless --overwrite).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace what --out holds.")


def _tokenizer_json(model_path):
    """The run's tokenizer.json (beside model.keras, in tokenizer/), or None."""
    import json
    config_path = os.path.join(os.path.dirname(model_path), "tokenizer", "config.json")
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        name = json.load(f).get("file") or ""
    path = os.path.join(os.path.dirname(config_path), name)
    return path if name.endswith("tokenizer.json") and os.path.isfile(path) else None


def main(argv):
    del argv
    from tfdist.errors import UsageError
    from tfdist.models import huggingface
    from tfdist.models.saved import load_model

    out = _OUT.value
    if not out:
        raise UsageError("give the directory to write: --out=<dir>")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) \
            and not _OVERWRITE.value:
        raise UsageError(f"{out} exists and is not empty; choose another --out or pass "
                         f"--overwrite")
    model = load_model(_MODEL.value)
    tokenizer = _tokenizer_json(_MODEL.value)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=parent)  # whole, or not at all
    try:
        huggingface.export(model, staging, tokenizer_file=tokenizer)
        if os.path.exists(out):
            shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    kind = huggingface.hf_config(model)["architectures"][0]
    print(f"tfdist export: {out}: {kind}, {model.num_params():,} parameters"
          + ("" if tokenizer else " (no tokenizer.json: the run's tokenizer is not a Hugging "
             "Face one)"))


def run(argv=None):
    cli.run(main, argv or sys.argv)


if __name__ == "__main__":
    run()
