"""TensorBoard event files in ``<folder>/tensorboard``: each tracked metric a scalar at step = the round, the
resolved config as text (torch's :class:`~torch.utils.tensorboard.SummaryWriter`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

LOGDIR = "tensorboard"


class TensorBoardWriter:
    """A run's TensorBoard log; resumed after round ``state["round"]``, with every event after it left by a
    crash discarded by TensorBoard's readers (``purge_step``: a ``SessionLog.START`` at that step)."""

    key = "tensorboard"

    def __init__(self, folder: Path, state: Mapping[str, Any], config_text: str) -> None:
        self.logdir = folder / LOGDIR
        self.round = int(state.get("round", 0))
        resumed = self.logdir.exists()
        self.first = self.round + 1 if resumed else 0  # the first step this writer writes
        self.writer = SummaryWriter(str(self.logdir), purge_step=self.first if resumed else None)
        self.writer.add_text("config", f"```yaml\n{config_text}```", global_step=self.round)
        self.writer.flush()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if step < self.first:  # written before the resume
            return
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # watchable at once, and kept if the run dies
        self.round = max(self.round, step)

    def state(self) -> dict[str, Any]:
        return {"round": self.round}

    def close(self, status: str) -> None:
        self.writer.close()
