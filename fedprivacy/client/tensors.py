"""Small tensor helpers of the client core (no config, no Flower)."""

from __future__ import annotations

import torch


def host_floats(values: list[torch.Tensor]) -> list[float]:
    """0-d tensors of one dtype (e.g. per-batch losses kept on the device) as Python numbers, in one transfer.

    ``float(t)`` in a training loop waits for the device at every batch; collecting the tensors and
    reading them once per client gives the same numbers (each converted exactly, as ``float(t)`` does).
    """
    return torch.stack(values).tolist() if values else []
