"""DP-FedAvg on the tag-round workload as a bare PyTorch loop: no Flower, no fedprivacy objects
(only its two clipping functions, pure torch math: the exact clip every engine must apply).

The practical limit for the in-process engine on this machine: the same math with nothing around
it. Per round: draw a cohort of ``m`` users without replacement; per user, run local SGD with the
closed-form softmax cross-entropy gradient on the same batches (data order from the same
per-(seed, round, user) generator as fedprivacy's trainer), accumulating the delta on the weight
rows of its words and the bias (the only parameters its loss reads or changes; the model is only
read, at the batch's words), clip the delta to L2 norm ``C`` (on the rigorous norm bound) and add it into the sum;
then ONE dense Gaussian draw of std ``zC`` over all 5,000,500 coordinates, divide by ``m`` and take
a server SGD step. Parameters are one ``(1 + V, K)`` matrix: row 0 the bias, row ``1 + w`` the
weights of word ``w`` (fedprivacy's flat order). Data: CSR arrays (``indptr``, ``indices``,
``data``), ``labels`` and user ``u``'s rows ``starts[u]:stops[u]`` (memory-mapped arrays are fine:
only the cohort's rows are read).

``cohorts`` (optional) fixes each round's users, so a test can check that the framework computes
the same model (noise 0). ``tags`` (optional, the multi-hot CSR ``(n, K)`` of the multi-label task,
Reddi et al. 2021, arXiv:2003.00295v5, App. C) replaces the softmax by the per-tag sigmoid BCE, mean
over the batch and the K tags: the logit gradient is ``(sigmoid(z) - t) / (B K)``. ``noise_std``
(optional) is the noise std on the sum instead of ``zC`` (large-cohort emulation: ``z C m / M``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from fedprivacy.privacy.clipping import clip_scale, l2_norm_bound  # pure torch: the clip every engine must apply

CLIENT_STREAM = 0x636C69656E74  # the trainer's data-order stream, so both loops see the same batches


def bare_dp_fedavg(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, labels: np.ndarray,
                   starts: np.ndarray, stops: np.ndarray, *, vocab: int = 10_000, classes: int = 500, rounds: int = 6,
                   cohort: int = 100, batch_size: int = 100, epochs: int = 1, client_lr: float = 30.0,
                   clip: float = 10.0, z: float = 1.0, server_lr: float = 1.0, seed: int = 0,
                   cohorts: list[np.ndarray] | None = None, tags=None,
                   noise_std: float | None = None) -> tuple[torch.Tensor, list[float]]:
    """Run ``rounds`` rounds; return the final ``(1 + V, K)`` parameters and each round's seconds."""
    params = torch.zeros(1 + vocab, classes)
    total = torch.zeros_like(params)
    noise_gen = torch.Generator().manual_seed(seed + 1)
    cohort_rng = np.random.default_rng(seed)
    population = len(starts)
    seconds = []
    for t in range(1, rounds + 1):
        t0 = time.perf_counter()
        users = cohorts[t - 1] if cohorts is not None else cohort_rng.choice(population, cohort, replace=False)
        total.zero_()
        for u in users:
            lo, hi = int(starts[u]), int(stops[u])
            rows_ptr = indptr[lo:hi + 1]
            cols = indices[rows_ptr[0]:rows_ptr[-1]]
            vals = data[rows_ptr[0]:rows_ptr[-1]]
            words, local_cols = np.unique(cols, return_inverse=True)
            cols, local_cols = cols.astype(np.int64), local_cols.astype(np.int64, copy=False)  # once per user
            rows = torch.from_numpy(np.concatenate([[0], words.astype(np.int64) + 1]))
            delta = torch.zeros(len(rows), classes)  # local SGD accumulates x_local - x_t; x_t is only read
            y = None if tags is not None else np.asarray(labels[lo:hi], dtype=np.int64)
            ptr = rows_ptr - rows_ptr[0]
            rng = np.random.default_rng(np.random.SeedSequence([seed, CLIENT_STREAM, t, int(u)]))
            n, first = hi - lo, True
            for _ in range(epochs):
                order = rng.permutation(n)
                for b0 in range(0, n, batch_size):
                    idx = order[b0:b0 + batch_size]
                    lengths = ptr[idx + 1] - ptr[idx]
                    offs = np.zeros(len(idx), dtype=np.int64)
                    np.cumsum(lengths[:-1], out=offs[1:])
                    row_of = np.repeat(np.arange(len(idx), dtype=np.int64), lengths)
                    pos = (ptr[idx] - offs)[row_of] + np.arange(len(row_of))
                    offsets = torch.from_numpy(offs)
                    bag_words = torch.from_numpy(local_cols[pos])
                    bag_w = torch.from_numpy(vals[pos].astype(np.float32))
                    logits = F.embedding_bag(torch.from_numpy(cols[pos]), params[1:], offsets,
                                             mode="sum", per_sample_weights=bag_w) + params[0]
                    if not first:  # at x_t + delta
                        logits += F.embedding_bag(bag_words, delta[1:], offsets, mode="sum",
                                                  per_sample_weights=bag_w) + delta[0]
                    first = False
                    if tags is None:
                        g_logits = torch.softmax(logits, 1)
                        g_logits[torch.arange(len(idx)), torch.from_numpy(y[idx])] -= 1.0
                        g_logits /= len(idx)
                    else:
                        target = torch.from_numpy(tags[lo + idx].toarray().astype(np.float32))
                        g_logits = torch.sigmoid(logits).sub_(target).div_(len(idx) * classes)
                    xt = torch.sparse_coo_tensor(torch.stack([bag_words, torch.from_numpy(row_of)]), bag_w,
                                                 (len(rows) - 1, len(idx)), check_invariants=False)
                    delta[0] -= client_lr * g_logits.sum(0)
                    weight = delta[1:]
                    torch.addmm(weight, xt, g_logits, alpha=-client_lr, out=weight)  # in place, no (r, K) temporary
            total.index_add_(0, rows, delta, alpha=clip_scale(l2_norm_bound(delta), clip))  # the same exact clip
        total.add_(torch.empty_like(total).normal_(0.0, z * clip if noise_std is None else noise_std,
                                                   generator=noise_gen))
        params.add_(total, alpha=server_lr / cohort)
        seconds.append(time.perf_counter() - t0)
    return params, seconds
