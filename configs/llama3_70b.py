"""llama3_70b: Llama 3 70B (80 layers, 64 query heads over 8 key/value heads, width 8192, SwiGLU
28672 wide, context 8192, vocab 128256, rotary base 500000, no biases, an untied head;
70,553,706,496 parameters), for planning (`tfdist plan --config=configs/llama3_70b.py`).

Source: Meta's Llama 3 model card and released config.json (meta-llama/Meta-Llama-3-70B), and
Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 3 (its shape, and the peak
learning rate 1.5e-4). The rest of the training is as configs/llama3_8b.py's (4M-token batches,
15T tokens, mixed bfloat16). The vocabulary is Llama 3's size: train it on Llama 3
tokens (`--config.data.tokenizer=<dir>/tokenizer.json`).
"""
from tfdist.config import llama3_config


def get_config():
    return llama3_config(n_layer=80, n_head=64, n_embd=8192, ffn_hidden=28672,
                         learning_rate=1.5e-4)
