"""The next-word workload on pfl-research (``pfl`` 0.6), run in its own venv by ``so_next_word_round.py``.

Equivalent DP-FedAvg: TFF's next-word LSTM (embedding 96, one LSTM layer of 670 units, projection
670 -> 96, output 96 -> V + 4; the same PyTorch layers as fedprivacy's ``NextWordLSTM``), loss the
mean cross-entropy over non-pad targets (``ignore_index=0``), local SGD (``torch.optim.SGD``,
1 epoch, batch 16, lr ``--client-lr``), each user's update re-weighted to 1 (``WeightByUser``),
clipped to L2 norm C and noised once on the server with std z C
(``CentrallyAppliedPrivacyMechanism(GaussianMechanism(C, z))``), averaged over the cohort
(``FederatedAveraging``: divisor = the total weight = the cohort), central SGD lr 1. Cohorts of
exactly ``--cohort`` users drawn from the same population (pfl's ``random`` sampler).

Input: ``--data DIR`` holding ``tokens.npz`` (``tokens``: ``(n, seq_len + 1)`` ids, ``offsets``: user
``u`` owns rows ``offsets[u]:offsets[u + 1]``) written by ``so_next_word_round.py``. Prints one JSON
line: per-round seconds, peak RSS. No fedprivacy import: this venv has only pfl and torch.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from pfl.data.dataset import Dataset
from pfl.metrics import Weighted

from pfl_common import run_dp_fedavg, seed_single_thread


class NextWordLSTM(torch.nn.Module):
    """Embedding -> LSTM -> Dense(embedding) -> Dense(classes), as TFF's baseline (and fedprivacy's model)."""

    def __init__(self, num_classes: int, embedding_size: int = 96, lstm_size: int = 670) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(num_classes, embedding_size)
        self.lstm = torch.nn.LSTM(embedding_size, lstm_size, batch_first=True)
        self.projection = torch.nn.Linear(lstm_size, embedding_size)
        self.output = torch.nn.Linear(embedding_size, num_classes)

    def forward(self, x):
        hidden, _ = self.lstm(self.embedding(x))
        return self.output(self.projection(hidden))

    def loss(self, x, y, eval=False):
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten(), ignore_index=0)

    @torch.no_grad()
    def metrics(self, x, y, eval=False):
        self.eval() if eval else self.train()
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten(), ignore_index=0, reduction="sum")
        return {"loss": Weighted(float(loss), int((y != 0).sum()))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cohort", type=int, default=100)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--z", type=float, default=1.0)
    ap.add_argument("--client-lr", type=float, default=0.5)
    ap.add_argument("--classes", type=int, default=10_004)
    args = ap.parse_args()
    seed_single_thread()
    arrays = np.load(f"{args.data}/tokens.npz")
    tokens, offsets = torch.from_numpy(arrays["tokens"].astype(np.int64)), arrays["offsets"]
    users = list(range(len(offsets) - 1))

    def make_dataset(user: int) -> Dataset:
        rows = tokens[offsets[user]:offsets[user + 1]]
        return Dataset(raw_data=[rows[:, :-1], rows[:, 1:]], user_id=str(user))

    net = NextWordLSTM(args.classes)
    run_dp_fedavg(net, make_dataset, users, rounds=args.rounds, cohort=args.cohort, clip=args.clip, z=args.z,
                  local_lr=args.client_lr, local_batch_size=16, eval_batch_size=256)


if __name__ == "__main__":
    main()
