"""Activation memory of one micro-batch: what autograd keeps from the forward for the backward.

Counted tensor by tensor from what transformers' layers save (bytes per token; a = bytes of model.dtype,
h hidden size, f feed-forward size, q = heads x head_dim, k = kv heads x head_dim, r LoRA rank):

    RMSNorm (Llama)            4h + a*h      its fp32 copy of the input; its output (read by the next linears)
    T5LayerNorm                4h + 2a*h     also its input: T5 multiplies the bf16 input by the fp32 scale
    attention (flash, SDPA)    a*(2q+2k)     q, k, v and the output; + 4 bytes of log-sum-exp per head
    gated MLP (SwiGLU)         4a*f          gate and up outputs, the activation, their product
    gated-gelu MLP (T5)        7a*f          T5's gelu_new is Python: it keeps four tensors, not one
    full fine-tuning           +a*h per norm the norm weight's gradient needs its input
    LoRA, each adapted linear  a*r           the low-rank intermediate; with lora dropout > 0 also the
                                             dropped-out input (a*in) and its mask (1 byte per element)
    dropout p > 0 (T5)         1 per element its mask (after attention, after the MLP, inside the MLP)

Attention scores (rows x heads x Lq x Lk) cost, per layer and element: T5 with SDPA, its position bias
folded with the padding mask into a float mask (a); eager attention, the softmax output (T5: a; Llama: fp32 4
+ its cast a) and, with attention dropout, its mask and output (1 + a); on CPU only, SDPA's math kernel,
which PyTorch picks when attention dropout > 0 (12 bytes in bf16, 16 in fp32, measured on torch 2.13).
Causal LMs on padded batches add the padding mask per layer (rows x L x L, a bytes: SDPA converts the
boolean mask each call); flash attention and lorakit's per-example SDPA for packed rows keep none.

The output head keeps the logits (a per vocabulary entry and token) for the loss; at the start of the
backward the loss makes their gradient (a) in one pass over fp32 chunks of CHUNK_ELEMENTS logits
(lorakit.model.loss: an fp32 softmax, its product with the incoming gradient, and its cast back: 8 + 2a
per chunk element; 8 in fp32, where the cast is free). Measured (tests/unit/test_plan.py): 2a per logit
plus 12 per chunk element in bf16. With the tiled loss (model.tiled_loss) no logits of the row exist: one
tile's (tile x vocabulary) logits in model dtype, their fp32 copy, log-softmax and gradients, 12 bytes per
element measured whatever the dtype, and, when the head trains, the running sum of its weight's gradient.

Sequence parallelism over N ranks (causal LMs) divides every per-token term by N: each rank runs the layers
on 1/N of the row, and attention on 1/N of the heads over the whole row (the same bytes).

A tiled MLP (model.tiled_mlp) keeps no MLP activations per token: its input is the norm output already
counted; one tile's MLP terms (and its feed-forward-wide gradients) are alive while the tile is recomputed.

With gradient checkpointing (non-reentrant, per layer) only each layer's input (a*h per token) is kept;
in the backward one layer at a time is recomputed. Selective checkpointing (every k-th block,
lorakit.model.checkpointing) keeps the input of the blocks it checkpoints and everything of the others: the
layers keep n*a*h + (L-n)*layer per token for n checkpointed blocks of L. The peak is the larger of two moments: the start of
the backward (kept + head) and the backward through the layers (kept + logits + the recomputed layer + the
gradients flowing through it), when DeepSpeed's gradient buffers are also allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lorakit.model.checkpointing import checkpointed_blocks
from lorakit.model.loss import CHUNK_ELEMENTS
from lorakit.planner.arch import Arch
from lorakit.planner.moe import expert_weights, moe_mlp


@dataclass(frozen=True)
class Shape:
    """Token counts of one micro-batch on one rank."""

    rows: int
    # Causal LMs: the row length (packed rows: train.max_tokens); encoder-decoders: the source length.
    seq_len: int
    # Encoder-decoders: the target length; None for causal LMs.
    target_len: int | None = None
    # Packed rows: the longest example, which bounds per-example attention; None: the row is one example.
    example_len: int | None = None
    # distributed.sequence_parallel: the row is split over this many ranks (causal LMs).
    sequence_parallel: int = 1
    # model.tiled_mlp: tokens per MLP tile (causal LMs); None: the MLP runs over the whole row.
    mlp_tile: int | None = None
    # model.tiled_loss: tokens per head-and-loss tile (causal LMs); None: logits of the whole row.
    loss_tile: int | None = None
    # Encoder-decoders: decoder passes over one encoder output, all kept for one loss (DPO: chosen and
    # rejected, 2).
    decoder_passes: int = 1


@dataclass(frozen=True)
class Kernels:
    """How attention runs: the backend, the device kind, and whether rows are packed."""

    attention: str
    device: str
    packed: bool


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch on one rank."""

    # Kept from the forward until the backward: every layer's saved tensors, or only the layer inputs with
    # checkpointing (plus what lives outside the layers: final norms, encoder output, shared masks).
    kept: int
    # The output head at the start of the backward: logits, their gradient and the loss's fp32 chunk (or
    # one tile's working set with the tiled loss).
    head: int
    # Logits alone (the loop holds them through the whole backward).
    logits: int
    # One layer recomputed in the backward with checkpointing; 0 without.
    recompute: int
    # The two moments of the module docstring: the start of the backward (kept + head) and the backward
    # through the layers (kept + logits + a recomputed layer + the gradients flowing through it).
    at_loss: int
    in_layers: int
    # The larger of the two.
    peak: int
    # The part of one layer's activations that grows with the square of the sequence length.
    quadratic_per_layer: int
    # A forward under no_grad over the same micro-batch (DPO's reference pass): its logits, one layer's
    # working tensors and, for encoder-decoders, the encoder output. Nothing is kept from it.
    no_grad_forward: int = 0
    # Blocks checkpointed (encoder and decoder together): 0 off, all of them whole, some selective.
    checkpointed: int = 0


def _math_kernel(k: Kernels, dropout: float) -> bool:
    # PyTorch's CPU SDPA has no fused kernel with dropout.
    return k.attention != "eager" and k.device == "cpu" and dropout > 0


def _norm(arch: Arch, a: int, full: bool, output: bool = True) -> int:
    t5 = arch.is_encoder_decoder
    out = 4 * arch.hidden + (a * arch.hidden if t5 else 0) + (a * arch.hidden if output else 0)
    return out + (a * arch.hidden if full else 0)


def _lora(arch: Arch, method, a: int, names: tuple[str, ...]) -> int:
    """Bytes per token the LoRA adapters of one layer keep on the linears whose last name is in `names`."""
    if method.kind == "full":
        return 0
    total, seen = 0, set()
    if method.kind == "ia3":
        # IA3 keeps the tensor it scales (a layer's output, a feedforward layer's input) for its gradient.
        for lin, ff in arch.ia3_targets(method.target_modules, method.feedforward_modules):
            short = lin.name.rsplit(".", 1)[-1]
            if short in names and short not in seen:
                seen.add(short)
                total += a * (lin.in_features if ff else lin.out_features)
        return total
    for lin in arch.lora_targets(method.target_modules):
        short = lin.name.rsplit(".", 1)[-1]
        if short in names and short not in seen:
            seen.add(short)
            total += a * method.r + ((a + 1) * lin.in_features if method.dropout > 0 else 0)
    return total


def _qkvo(arch: Arch, k: Kernels, a: int, queries: bool = True, keys: bool = True) -> int:
    """q and output (per query token), k and v (per key token), as the attention kernel keeps them; the
    CPU math kernel also keeps fp32 copies of bf16 q, k and v."""
    q, kv = arch.attention_width, arch.kv_width
    copy = 4 if _math_kernel(k, arch.attention_dropout) and a < 4 else 0
    out = 0
    if queries:
        out += (2 * a + copy) * q + 4 * arch.heads
    if keys:
        out += (2 * a + 2 * copy) * kv
    return out


def _per_score(arch: Arch, k: Kernels, a: int) -> int:
    """Bytes per attention score element (rows x heads x Lq x Lk) one layer keeps."""
    p = arch.attention_dropout
    if _math_kernel(k, p):
        return 12 if a < 4 else 16
    t5 = arch.is_encoder_decoder
    if k.attention == "eager":
        return (a if t5 else 4 + a) + ((1 + a) if p > 0 else 0)
    # SDPA or flash: T5 folds its position bias into a float mask per layer; causal LMs keep no scores.
    return a if t5 else 0


_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2")


def causal_mlp(arch: Arch, method, a: int) -> int:
    """Bytes per token a causal LM's MLP keeps (its LoRA terms included; MoE: lorakit.planner.moe)."""
    if arch.experts is not None:
        return moe_mlp(arch, a) + _lora(arch, method, a, _MLP_NAMES)
    return (4 if arch.gated_mlp else 2) * a * arch.ffn + _lora(arch, method, a, _MLP_NAMES)


def causal_layer(arch: Arch, method, a: int, k: Kernels, tiled: bool = False) -> int:
    """Bytes per token one decoder layer of a causal LM keeps (no checkpointing), scores excluded; `tiled`
    (model.tiled_mlp): the MLP keeps nothing per token, its tile's share is counted per layer instead."""
    full = method.kind == "full"
    mlp = 0 if tiled else causal_mlp(arch, method, a)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    return 2 * _norm(arch, a, full) + _qkvo(arch, k, a) + mlp + _lora(arch, method, a, names)


def t5_ff(arch: Arch, method, a: int) -> int:
    """Bytes per token a T5 feed-forward sub-layer keeps, its layer norm and dropout masks included."""
    f, p = arch.ffn, arch.dropout
    act = 4 if arch.python_gelu else 1
    mlp = (act + 2 + 1) * a * f if arch.gated_mlp else (act + 1) * a * f
    masks = (f + arch.hidden) if p > 0 else 0
    lora = _lora(arch, method, a, ("wi", "wi_0", "wi_1", "wo"))
    return _norm(arch, a, method.kind == "full") + mlp + masks + lora


def t5_self_attention(arch: Arch, method, a: int, k: Kernels) -> int:
    """Bytes per token a T5 self-attention sub-layer keeps (layer norm, q/k/v/o, dropout mask)."""
    mask = arch.hidden if arch.dropout > 0 else 0
    lora = _lora(arch, method, a, ("q", "k", "v", "o"))
    return _norm(arch, a, method.kind == "full") + _qkvo(arch, k, a) + mask + lora


def t5_cross_attention(arch: Arch, method, a: int, k: Kernels, source_len: int, target_len: int) -> int:
    """Bytes per decoder token a T5 cross-attention sub-layer keeps: layer norm, q and output over the
    decoder tokens, and k and v (with their LoRA terms) over the encoder tokens."""
    ratio = source_len / target_len
    mask = arch.hidden if arch.dropout > 0 else 0
    per_query = _norm(arch, a, method.kind == "full") + _qkvo(arch, k, a, keys=False) + mask
    per_key = _qkvo(arch, k, a, queries=False) + _lora(arch, method, a, ("k", "v"))
    return int(per_query + _lora(arch, method, a, ("q", "o")) + per_key * ratio)


def activations(arch: Arch, method, a: int, k: Kernels, shape: Shape, checkpointing: bool,
                every: int | None = None) -> Activations:  # fmt: skip
    """Activation bytes of one micro-batch (see the module docstring); `every`: with `checkpointing`,
    every k-th block only (selective); None: every block."""
    if arch.is_encoder_decoder:
        return _seq2seq(arch, method, a, k, shape, checkpointing, every or 1)
    return _causal(arch, method, a, k, shape, checkpointing, every or 1)


def _head(
    arch: Arch, a: int, out_tokens: int, tile: int | None = None, trains: bool = False, chunk=CHUNK_ELEMENTS
) -> tuple[int, int]:
    """(head bytes at the start of the backward, logits bytes); `tile`: the tiled loss's tokens per tile,
    `trains`: the head's weight trains (full fine-tuning); `chunk`: the loss's fp32 chunk (module
    docstring)."""
    if tile:
        return 12 * min(tile, out_tokens) * arch.vocab + (a * arch.vocab * arch.hidden if trains else 0), 0
    logits = out_tokens * arch.vocab * a
    working = min(out_tokens * arch.vocab, chunk) * (8 + (2 * a if a < 4 else 0))
    return 2 * logits + working, logits


def _working(arch: Arch, a: int, tokens: int, ffn_tokens: int | None = None) -> int:
    # Gradients flowing through one layer: about three feed-forward-wide tensors at once (the gradient of
    # the MLP product and of its two inputs; one tile's with a tiled MLP) and the incoming and outgoing
    # hidden-state gradients.
    return a * (3 * arch.ffn * (tokens if ffn_tokens is None else ffn_tokens) + 2 * arch.hidden * tokens)


def _finish(layers_kept: int, one_layer: int, outside: int, head: int, logits: int, quadratic: int,
            checkpointing: bool, working: int) -> Activations:  # fmt: skip
    kept = layers_kept + outside
    recompute = one_layer if checkpointing else 0
    at_loss, in_layers = kept + head, kept + logits + recompute + working
    return Activations(kept, head, logits, recompute, at_loss, in_layers, max(at_loss, in_layers), quadratic)


def _causal(
    arch: Arch, method, a: int, k: Kernels, shape: Shape, checkpointing: bool, every: int
) -> Activations:
    rows, seq, n = shape.rows, shape.seq_len, shape.sequence_parallel
    # Sequence parallelism: every layer but attention runs on 1/N of the (padded) row; attention, after
    # its all-to-all, keeps 1/N of the heads over the whole row: the same bytes as all heads over 1/N.
    tokens = rows * -(-seq // n)
    # Per-example attention in packed rows (varlen flash, per-example SDPA) sees examples of at most
    # example_len tokens; eager attention over a packed row masks the whole row.
    span = seq if (k.attention == "eager" or not k.packed) else min(shape.example_len or seq, seq)
    quadratic = rows * (arch.heads // n) * seq * span * _per_score(arch, k, a)
    shared_mask = 0
    if k.attention == "eager":
        # One 4-D float mask for all layers (packed rows: lorakit's block-diagonal mask).
        shared_mask = rows * seq * seq * a
    elif k.attention == "sdpa" and not k.packed:
        # Padded batches: a boolean mask shared by the layers, converted to model.dtype by every SDPA call.
        shared_mask = rows * seq * seq
        quadratic += rows * seq * seq * a
    # Tiled MLP: what one tile keeps while it is recomputed in the backward, instead of the whole row's.
    tile = min(shape.mlp_tile, tokens) if shape.mlp_tile else None
    mlp_tile = tile * causal_mlp(arch, method, a) if tile else 0
    layer = tokens * causal_layer(arch, method, a, k, tiled=tile is not None) + quadratic + mlp_tile
    layer += expert_weights(arch, method, a)
    # Final norm (its output too when the head trains), rotary cos/sin shared by the layers.
    full = method.kind == "full"
    outside = tokens * (_norm(arch, a, full, output=full) + 2 * a * arch.head_dim) + shared_mask
    head, logits = _head(arch, a, tokens, shape.loss_tile, full)
    n = checkpointed_blocks(arch.layers, every) if checkpointing else 0
    kept_layers = n * tokens * a * arch.hidden + (arch.layers - n) * layer
    working = _working(arch, a, tokens, tile)
    act = _finish(kept_layers, layer, outside, head, logits, quadratic, n > 0, working)
    return replace(act, no_grad_forward=logits + working, checkpointed=n)


def _seq2seq(
    arch: Arch, method, a: int, k: Kernels, shape: Shape, checkpointing: bool, every: int
) -> Activations:
    rows, src, tgt = shape.rows, shape.seq_len, shape.target_len or shape.seq_len
    # Every decoder pass keeps its own activations (and logits) until the backward: count its tokens as
    # decoder tokens; the decoder's attention spans stay those of one pass.
    s_tok, t_tok = rows * src, rows * tgt * shape.decoder_passes
    # Packed rows with per-example attention: each example attends within itself.
    s_span = min(shape.example_len or src, src) if k.packed and k.attention != "eager" else src
    t_span = tgt if not (k.packed and k.attention != "eager") else max(1, round(tgt * s_span / src))
    score = _per_score(arch, k, a)
    h = arch.heads
    enc_q = rows * h * src * s_span * score
    dec_q = shape.decoder_passes * rows * h * tgt * (t_span + s_span) * score
    sub = t5_self_attention(arch, method, a, k) + t5_ff(arch, method, a)
    enc = s_tok * sub + enc_q
    dec = t_tok * (sub + t5_cross_attention(arch, method, a, k, src, tgt)) + dec_q
    drop = 1 if arch.dropout > 0 else 0
    full = method.kind == "full"
    # Embedding and final dropout masks and the final norm of both stacks; the encoder output, which every
    # cross-attention k/v projection reads.
    outside = (s_tok + t_tok) * (
        2 * drop * arch.hidden + _norm(arch, a, full, output=False)
    ) + s_tok * a * arch.hidden
    if full:
        outside += t_tok * a * arch.hidden
    head, logits = _head(arch, a, t_tok)
    # transformers numbers the blocks over the encoder's, then the decoder's (lorakit.model.checkpointing).
    n_enc = checkpointed_blocks(arch.layers, every) if checkpointing else 0
    n_dec = checkpointed_blocks(arch.decoder_layers, every, start=arch.layers) if checkpointing else 0
    kept_layers = (n_enc * s_tok + n_dec * t_tok) * a * arch.hidden
    kept_layers += (arch.layers - n_enc) * enc + (arch.decoder_layers - n_dec) * dec
    # The position bias of each stack is an input of every checkpointed block: kept once.
    outside += h * ((src * s_span if n_enc else 0) + (tgt * t_span if n_dec else 0)) * a
    # The backward recomputes (and the gradients flow through) one layer of one pass at a time.
    passes = shape.decoder_passes
    working = max(_working(arch, a, s_tok), _working(arch, a, t_tok // passes))
    act = _finish(
        kept_layers, max(enc, dec // passes), outside, head, logits, max(enc_q, dec_q // passes),
        n_enc + n_dec > 0, working,
    )  # fmt: skip
    return replace(
        act, no_grad_forward=logits + working + s_tok * a * arch.hidden, checkpointed=n_enc + n_dec
    )
