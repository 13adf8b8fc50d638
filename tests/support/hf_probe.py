"""Run by tests/test_huggingface.py in a fresh process (the CPU must be split into logical devices
before TF starts): loads a Hugging Face checkpoint directory into a layout and prints one
`PROBE {...}` JSON line with its logits' largest difference from transformers' (saved beside
it by the test as reference_logits.npy, for the ids in reference_ids.npy).

    python tests/support/hf_probe.py DIR single|tp_sp|stages
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tfdist.parallel.layout import configure_logical_cpus  # noqa: E402

configure_logical_cpus(2)

from tfdist.models import huggingface  # noqa: E402
from tfdist.models.gpt import GPT  # noqa: E402
from tfdist.models.pipeline import Pipeline  # noqa: E402

directory, layout = sys.argv[1], sys.argv[2]
checkpoint = huggingface.Checkpoint(directory)
gpt = GPT.from_model_config(checkpoint.model_config())
model = {"single": lambda: gpt,
         "tp_sp": lambda: Pipeline(gpt, stages=1, tensor_parallel=2, sequence_parallel=True),
         "stages": lambda: Pipeline(gpt, stages=2, microbatches=2)}[layout]()
model.build()
huggingface.load_weights(model, checkpoint)
ids = np.load(os.path.join(directory, "reference_ids.npy")).astype("int32")
logits = np.asarray(model(ids))
reference = np.load(os.path.join(directory, "reference_logits.npy"))
print("PROBE " + json.dumps({"max_diff": float(np.abs(logits - reference).max()),
                             "describe": model.describe() if layout != "single" else "single",
                             "scale": float(np.abs(reference).max())}))
