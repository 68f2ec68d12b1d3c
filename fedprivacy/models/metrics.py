"""Metrics of the StackOverflow tasks, as TFF reports them.

* :func:`recall_at_k_counts`: ``tf.keras.metrics.Recall(top_k=5)`` of TFF's multi-label tag task
  (``tag_prediction_tasks.py``): over all (post, tag) pairs with a true tag, the share whose
  tag is among the post's ``k`` highest scores, i.e. ``sum_i |top_k(i) & T_i| / sum_i |T_i|``
  (micro-averaged; posts without a true tag add nothing).
* :func:`masked_accuracy_counts`: ``MaskedCategoricalAccuracy`` of TFF's next-word task: argmax of the
  logits equals the target, over positions whose target is not a masked token.
"""

from __future__ import annotations

import torch

__all__ = ["recall_at_k_counts", "masked_accuracy_counts"]


def recall_at_k_counts(scores: torch.Tensor, targets: torch.Tensor, k: int = 5
                       ) -> tuple[int, int]:
    """``(hits, positives)`` for recall@k: true tags among the top-``k`` scores, true tags.

    Args:
        scores: ``(n, num_tags)`` logits or probabilities.
        targets: ``(n, num_tags)`` multi-hot 0/1.
    """
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    hits = targets.gather(1, top).sum()
    return int(hits), int(targets.sum())


def masked_accuracy_counts(logits: torch.Tensor, targets: torch.Tensor,
                           masked: tuple[int, ...]) -> tuple[int, int]:
    """``(correct, counted)`` of argmax predictions over targets not in ``masked``.

    Args:
        logits: ``(..., num_classes)``.
        targets: int ``(...)``.
        masked: Target ids left out (TFF: pad, OOV, EOS).
    """
    keep = torch.ones_like(targets, dtype=torch.bool)
    for token in masked:
        keep &= targets != token
    correct = (logits.argmax(dim=-1) == targets) & keep
    return int(correct.sum()), int(keep.sum())
