"""llama3_8b: Llama 3 8B (32 layers, 32 query heads over 8 key/value heads, width 4096, SwiGLU
14336 wide, context 8192, vocab 128256, rotary base 500000, no biases, an untied head; 8,030,261,248
parameters), for planning (`tfdist plan --config=configs/llama3_8b.py`) and real hardware.

Source: Meta's Llama 3 model card and released config.json (meta-llama/Meta-Llama-3-8B), and
Llama Team, "The Llama 3 Herd of Models", arXiv:2407.21783, Table 3 (its shape, and the peak
learning rate 3e-4). The rest of the training is as Llama 2's (arXiv:2307.09288) where the paper
gives none for 8B: batches of 512 x 8192 tokens (4M), 15T tokens (the model card's), 2,000 warmup
steps, a cosine to a tenth of the peak, AdamW (0.9, 0.95), weight decay 0.1, clipping at 1.0;
mixed bfloat16. The vocabulary is Llama 3's size: train it on Llama 3 tokens
(`--config.data.tokenizer=<dir>/tokenizer.json`); with a smaller tokenizer the extra rows go
unused.
"""
from tfdist.config import llama3_config


def get_config():
    return llama3_config(n_layer=32, n_head=32, n_embd=4096, ffn_hidden=14336,
                         learning_rate=3e-4)
