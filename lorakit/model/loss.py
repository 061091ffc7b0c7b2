"""Token-weighted loss: the step loss is total token loss / total target tokens, not a mean of means.

The cross-entropy is computed in fp32 (bf16 log-softmax over a 32k+ vocabulary loses the precision the sum
needs) but never over a whole row at once: a packed row of 16k tokens of a 128k-vocabulary model would need
8 GB for its fp32 logits and as much again for the log-softmax autograd keeps. `token_loss_sum` walks the
row in chunks of about CHUNK_ELEMENTS logits, in the forward and again in the backward, so the fp32 working
set is one chunk; what stays is the model's own logits (in model.dtype) and their gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorakit.data.collate import IGNORE_INDEX

# fp32 logits handled at once (2**25 x 4 bytes = 128 MiB): 256 tokens of a 128k vocabulary, 1024 of 32k.
CHUNK_ELEMENTS = 2**25


def _chunks(n_tokens: int, vocab: int, chunk_elements: int) -> list[tuple[int, int]]:
    step = max(1, chunk_elements // max(vocab, 1))
    return [(s, min(s + step, n_tokens)) for s in range(0, n_tokens, step)]


class _ChunkedTokenCE(torch.autograd.Function):
    """Cross-entropy of each label under (N, V) logits, (N,) fp32, 0 on ignored tokens (labels == -100);
    one chunk of tokens at a time. The one chunked function behind token_loss_sum (its sum) and
    sequence_log_probs (its negation).

    Backward recomputes each chunk's softmax instead of keeping fp32 activations: d CE / d logits is
    softmax(logits) - onehot(label) on target tokens and 0 on ignored ones."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_elements: int) -> torch.Tensor:
        out = torch.zeros(logits.size(0), dtype=torch.float32, device=logits.device)
        spans = _chunks(logits.size(0), logits.size(1), chunk_elements)
        for s, e in spans:
            out[s:e] = F.cross_entropy(
                logits[s:e].float(), labels[s:e], ignore_index=IGNORE_INDEX, reduction="none"
            )
        ctx.save_for_backward(logits, labels)
        ctx.spans = spans
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s, e in ctx.spans:
            g = torch.softmax(logits[s:e].float(), dim=-1)
            target = (labels[s:e] != IGNORE_INDEX).unsqueeze(1)
            # Dense ops only: selecting the target rows (nonzero, boolean indexing) waits for the GPU on every
            # chunk. Ignored rows subtract at index 0 and are zeroed with the rest of their row.
            g.scatter_add_(1, labels[s:e].clamp_min(0).unsqueeze(1), -target.to(g.dtype))
            grad[s:e] = (g * (target * grad_out[s:e, None])).to(grad.dtype)
        return grad, None, None


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """Summed cross-entropy over the target tokens of a batch (labels == -100 are ignored), in fp32, over
    chunks of about `chunk_elements` logits (module docstring)."""
    return _ChunkedTokenCE.apply(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1).to(logits.device), chunk_elements
    ).sum()


def micro_batch_loss(loss_sum: torch.Tensor, window_tokens: float, world_size: int) -> torch.Tensor:
    """What to backpropagate for one micro-batch of an accumulation window.

    DeepSpeed averages gradients over ranks, so scaling by world_size / (target tokens of the whole window
    on all ranks) makes the applied gradient d(sum of all token losses) / (all tokens): the gradient of the
    token-weighted mean, whatever the split into micro-batches and ranks.
    """
    return loss_sum * (world_size / max(window_tokens, 1.0))


def sequence_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    sequence_ids: torch.Tensor,
    num_sequences: int,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """(num_sequences,) fp32 summed log-probabilities of the target tokens (labels != -100) of each sequence;
    `sequence_ids` (shaped like `labels`) names the sequence of every token: a padded row, or one segment of
    a packed row. Chunked in fp32 like `token_loss_sum`."""
    flat = logits.reshape(-1, logits.size(-1))
    token = -_ChunkedTokenCE.apply(flat, labels.reshape(-1).to(logits.device), chunk_elements)
    index = sequence_ids.reshape(-1).to(logits.device)
    return torch.zeros(num_sequences, dtype=torch.float32, device=logits.device).index_add(0, index, token)
