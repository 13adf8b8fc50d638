"""Transformer arithmetic: a decoder-only transformer's parameters, FLOPs per token, activation
bytes per layer and model-state bytes per parameter, from its sizes alone.

The one copy. The GPT (`GPT.num_params`, `GPT.flops_per_token`), the pipeline (`block_costs`,
which balances its stages, and `Pipeline.memory_estimate`, which a run prints) and `tfdist plan`
all count here, so they cannot disagree (tests/test_arithmetic.py). Pure Python: no TensorFlow.

Conventions, in the order below:

* parameters: every weight, the tied output head counted once (as Keras counts a built GPT);
  non-embedding leaves out the embeddings that are only looked up: the position embeddings
  (nanoGPT's convention: a tied token embedding is the head's weight, so it stays), and with an
  untied head the token embedding too (torchtitan's for Llama: its head stays);
* FLOPs: 2 per multiply-add. `flops_per_token` is nanoGPT's (PaLM's appendix B) 6 N + 12 L C T;
  `model_flops_per_token` is Megatron-LM's 3 x (matmuls + attention + head), used for MFU;
* activations: the bytes one layer keeps for its backward pass, Korthikanti et al. 2022;
* model states: bytes per parameter of weights, gradients and optimizer states (ZeRO's).

Precision is "mixed" (16-bit compute, float32 master weights) or "float32".

Example: GPT-2 124M, one sequence of 1,024 tokens.

>>> from tfdist.models.arithmetic import Transformer, state_bytes_per_param
>>> gpt2 = Transformer(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq_len=1024)
>>> gpt2.params(), gpt2.non_embedding_params()
(124439808, 123653376)
>>> gpt2.flops_per_token()
855166464

One layer's activations in MiB, s h (34 + 5 a s / h), and with recomputation only its input:

>>> gpt2.activation_bytes_per_layer(tokens=1024, precision="mixed") / 2**20
85.5
>>> gpt2.activation_bytes_per_layer(tokens=1024, precision="mixed", recompute=True) / 2**20
1.5
>>> state_bytes_per_param("mixed"), state_bytes_per_param("float32")
((2, 2, 12), (4, 4, 8))
"""
import dataclasses
import math

PRECISIONS = ("mixed", "float32")


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's sizes. The defaults are GPT-2's kind (and tfdist's GPT):
    multi-head attention, a GELU MLP 4 x n_embd wide, biases, an output head tied to the token
    embedding, learned position embeddings."""
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    n_kv_head: int = 0  # 0: = n_head (multi-head); fewer: grouped-query attention
    ffn: int = 0  # MLP width; 0: 4 x n_embd
    gated_mlp: bool = False  # SwiGLU (three matrices) instead of GELU (two)
    bias: bool = True
    tied_embeddings: bool = True
    learned_positions: bool = True
    rms_norm: bool = False  # RMSNorm (a scale only) instead of LayerNorm (scale and shift)
    dropout: bool = True  # dropout masks are stored for the backward pass
    flash_attention: bool = False  # the attention matrix is never stored (FlashAttention, xformers)

    @property
    def kv(self):
        """Width of the keys (and of the values)."""
        return self.n_embd * (self.n_kv_head or self.n_head) // self.n_head

    @property
    def ffn_width(self):
        return self.ffn or 4 * self.n_embd

    # -- parameters ------------------------------------------------------------------------------
    def layer_matmul_params(self):
        """One layer's matrices: query and output (h x h each), keys and values (h x kv each),
        the MLP's two (GELU) or three (SwiGLU) h x ffn."""
        h = self.n_embd
        return 2 * h * h + 2 * h * self.kv + (3 if self.gated_mlp else 2) * h * self.ffn_width

    def layer_params(self):
        """One layer: its matrices, two norms (scale, and shift with biases), and the biases."""
        h, f = self.n_embd, self.ffn_width
        small = 2 * self.norm_params()  # two norms
        if self.bias:
            small += 2 * h + 2 * self.kv + f * (2 if self.gated_mlp else 1) + h
        return self.layer_matmul_params() + small

    def norm_params(self):
        """One norm's: a scale, and a shift (LayerNorm with biases)."""
        return 2 * self.n_embd if self.bias and not self.rms_norm else self.n_embd

    def head_params(self):
        """The output head's matrix (the token embedding itself, if tied)."""
        return self.vocab_size * self.n_embd

    def embedding_params(self):
        """Everything outside the layers: token embeddings (and an untied head), position
        embeddings, the final norm."""
        h = self.n_embd
        return (self.vocab_size * h * (1 if self.tied_embeddings else 2)
                + (self.seq_len * h if self.learned_positions else 0) + self.norm_params())

    def params(self):
        return self.n_layer * self.layer_params() + self.embedding_params()

    def non_embedding_params(self):
        """Without the embeddings only looked up, which no token multiplies by: the position
        embeddings, and the token embedding when the head is untied (tied, it is the head's
        weight: nanoGPT; untied: torchtitan's `get_num_params(exclude_embedding=True)`)."""
        looked_up = ((self.seq_len * self.n_embd if self.learned_positions else 0)
                     + (0 if self.tied_embeddings else self.vocab_size * self.n_embd))
        # (not self.params(): tfdist.plan.Model makes that a property)
        return self.n_layer * self.layer_params() + self.embedding_params() - looked_up

    # -- FLOPs per token -------------------------------------------------------------------------
    def layer_flops(self):
        """Forward FLOPs of one layer per token: its matmuls, and attention's QK^T and AV
        (counted over the whole sequence, Megatron-LM's convention)."""
        return 2 * self.layer_matmul_params() + 4 * self.seq_len * self.n_embd

    def head_flops(self):
        return 2 * self.n_embd * self.vocab_size

    def embedding_flops(self):
        """The embedding's nominal cost per token (token + position add), for balancing stages."""
        return 2 * self.n_embd

    def model_flops_per_token(self):
        """Training FLOPs per token, forward + backward, without recomputation (for MFU)."""
        return 3 * (self.n_layer * self.layer_flops() + self.head_flops())

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token (forward + backward), nanoGPT / PaLM: 6 N + 12 L C T, N the
        non-embedding parameters, T the attended context (default: seq_len)."""
        T = seq_len or self.seq_len
        return 6 * self.non_embedding_params() + 12 * self.n_layer * self.n_embd * T

    # -- activation bytes ------------------------------------------------------------------------
    def hidden_bytes(self, tokens, precision="mixed"):
        """One hidden state (tokens x n_embd values): a layer's input, or what a stage sends on."""
        return tokens * self.n_embd * value_bytes(precision)

    def activation_bytes_per_layer(self, tokens, precision="mixed", tp=1, recompute=False,
                                   sp=False):
        """Bytes one transformer layer keeps for its backward pass, for `tokens` tokens of one
        microbatch, its tensors split over `tp` tensor-parallel ranks. Korthikanti et al. 2022
        (arXiv:2205.05198) eq. 2: s b h (34 + 5 a s / h) at 2 bytes per value, of which
        24 + 5as/h are split by tensor parallelism. Generalised here to grouped-query attention,
        gated MLPs, no dropout and FlashAttention (no s x s matrices). With `sp` (sequence
        parallelism, eq. 4: s b h (34/t + 5 a s / (h t))) the rest is split over the t ranks too.
        With `recompute` the layer keeps only its input, and the rest is computed again in the
        backward pass."""
        if recompute:
            return self.hidden_bytes(tokens, precision)
        h, t = self.n_embd, tp
        value = 2 if precision == "float32" else 1  # in units of the paper's 2-byte values
        # attention-output and MLP-output dropout masks, 1 byte each
        masks = 2 if self.dropout else 0
        unsplit = 8 * value + masks  # two norms' inputs 4, attention and MLP inputs 4
        split = (4 + 4 * self.kv / h + (8 if self.gated_mlp else 4) * self.ffn_width / h) * value
        scores = 0 if self.flash_attention else (
            (4 * value + 1) if self.dropout else 2 * value) * self.n_head * self.seq_len / h
        return tokens * h * (unsplit / (t if sp else 1) + (split + scores) / t)

    def logits_bytes(self, tokens, tp=1):
        """The head's float32 logits (also under mixed precision), split over `tp` ranks."""
        return tokens * self.vocab_size * 4 / tp


def default_ffn_hidden(arch, n_embd):
    """The MLP's hidden width when the config leaves it 0 (`model.ffn_hidden`): GPT-2's 4 x
    n_embd; Llama's SwiGLU 2/3 of that (the same parameters in three matrices), rounded up to a
    multiple of 64."""
    return 64 * math.ceil(8 * n_embd / 3 / 64) if arch == "llama" else 4 * n_embd


def value_bytes(precision):
    """Bytes per activation value: 2 in mixed precision (bf16/fp16), 4 in float32."""
    return 4 if precision == "float32" else 2


# -- model states ----------------------------------------------------------------------------------

def state_bytes_per_param(precision="mixed", optimizer_slots=2):
    """(weights, gradients, optimizer states) bytes per parameter, with `optimizer_slots` float32
    slots per parameter (Adam: 2 moments). Mixed precision is the ZeRO paper's: fp16 weights and
    gradients, and fp32 master weights + Adam's two moments (K = 12)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if precision == "mixed":
        return (2, 2, 4 + 4 * optimizer_slots)
    return (4, 4, 4 * optimizer_slots)


STATE_BYTES = {p: state_bytes_per_param(p) for p in PRECISIONS}  # Adam's
