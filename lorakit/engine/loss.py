"""Token-weighted loss: the step loss is total token loss / total target tokens, not a mean of means."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorakit.data.collate import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the target tokens of a batch (labels == -100 are ignored).

    Computed in fp32: bf16 log-softmax over a 32k vocabulary loses the precision the sum needs.
    """
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def micro_batch_loss(loss_sum: torch.Tensor, window_tokens: float, world_size: int) -> torch.Tensor:
    """What to backpropagate for one micro-batch of an accumulation window.

    DeepSpeed averages gradients over ranks, so scaling by world_size / (target tokens of the whole window
    on all ranks) makes the applied gradient d(sum of all token losses) / (all tokens): the gradient of the
    token-weighted mean, whatever the split into micro-batches and ranks.
    """
    return loss_sum * (world_size / max(window_tokens, 1.0))
