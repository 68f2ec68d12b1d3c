"""The tag-round workload on pfl-research (``pfl`` 0.6), run in its own venv by ``so_tag_round.py``.

Equivalent DP-FedAvg: logistic regression 10,000 -> 500 as ``EmbeddingBag(sparse=True)`` (the
model fedprivacy uses; fixed-length bags, padding entries have weight 0, so logits and gradients are
exactly those of the CSR rows), local SGD (``torch.optim.SGD``, 1 epoch, batch 100, lr 30), each
user's update re-weighted to 1 (``WeightByUser``), clipped to L2 norm C and noised once on the
server with std z C (``CentrallyAppliedPrivacyMechanism(GaussianMechanism(C, z))``), averaged over
the cohort (``FederatedAveraging``: divisor = the total weight = the cohort of 100), central SGD
lr 1. Cohorts of exactly 100 users drawn from the same population (pfl's ``random`` sampler).

Input: ``--data DIR`` holding ``tags.npz`` (``indptr``, ``indices``, ``data``, ``labels``,
``offsets``) written by ``so_tag_round.py``. Prints one JSON line: per-round seconds, peak RSS.
No fedprivacy import: this venv has only pfl and torch.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from pfl.data.dataset import Dataset
from pfl.metrics import Weighted

from pfl_common import run_dp_fedavg, seed_single_thread


class BagLR(torch.nn.Module):
    """``x @ W + b`` on fixed-length bags of (word, weight); weight-0 entries are padding."""

    def __init__(self, vocab: int, classes: int) -> None:
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(vocab, classes, mode="sum", sparse=True)
        self.bias = torch.nn.Parameter(torch.zeros(classes))
        torch.nn.init.zeros_(self.embedding.weight)

    def forward(self, words, weights):
        return self.embedding(words, per_sample_weights=weights) + self.bias

    def loss(self, words, weights, labels, eval=False):
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(words, weights), labels)

    @torch.no_grad()
    def metrics(self, words, weights, labels, eval=False):
        self.eval() if eval else self.train()
        loss = torch.nn.functional.cross_entropy(self(words, weights), labels, reduction="sum")
        return {"loss": Weighted(float(loss), len(labels))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cohort", type=int, default=100)
    ap.add_argument("--clip", type=float, default=10.0)
    ap.add_argument("--z", type=float, default=1.0)
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--classes", type=int, default=500)
    args = ap.parse_args()
    seed_single_thread()
    arrays = np.load(f"{args.data}/tags.npz")
    indptr, indices, values = arrays["indptr"], arrays["indices"], arrays["data"]
    labels, offsets = arrays["labels"], arrays["offsets"]
    users = list(range(len(offsets) - 1))

    def make_dataset(user: int) -> Dataset:
        lo, hi = offsets[user], offsets[user + 1]
        rows = indptr[lo:hi + 1]
        width = max(1, int(np.max(np.diff(rows))) if hi > lo else 1)
        words = np.zeros((hi - lo, width), dtype=np.int64)
        weights = np.zeros((hi - lo, width), dtype=np.float32)
        for j in range(hi - lo):
            a, b = rows[j], rows[j + 1]
            words[j, :b - a], weights[j, :b - a] = indices[a:b], values[a:b]
        return Dataset(raw_data=[torch.from_numpy(words), torch.from_numpy(weights),
                                 torch.from_numpy(labels[lo:hi].astype(np.int64))], user_id=str(user))

    net = BagLR(args.vocab, args.classes)
    run_dp_fedavg(net, make_dataset, users, rounds=args.rounds, cohort=args.cohort, clip=args.clip, z=args.z,
                  local_lr=30.0, local_batch_size=100, eval_batch_size=4096)


if __name__ == "__main__":
    main()
