"""DP-FedAvg on the next-word workload as a bare PyTorch loop: no Flower, no fedprivacy objects
(only its clipping functions, pure torch math: the exact clip every engine must apply).

The practical limit for the in-process engine: the same math with nothing around it. Per round,
for each user of the cohort: local SGD (``torch.optim.SGD``, lr ``client_lr``) from the global
weights ``x_t`` on batches of ``batch_size`` of its token rows, in the order drawn from the same
per-(seed, round, user) generator as fedprivacy's trainer, minimising the mean cross-entropy over
non-pad targets (``ignore_index=0``, the task's loss); the flat delta
:math:`\\Delta_i = x_i - x_t`, clipped to L2 norm ``C`` (on the rigorous norm bound) and added into
the sum; the model is reset to ``x_t``. Then ONE Gaussian draw of std ``zC`` over all coordinates,
division by the cohort ``m`` and a server SGD step (McMahan et al. 2018, arXiv:1710.06963v3, Alg. 1
with fixed-size cohorts and a fixed divisor).

``tokens`` holds one ``seq_len + 1`` row per post, user ``u`` owns rows ``starts[u]:stops[u]``;
``cohorts`` fixes each round's users (the in-process run's sampler, so both train the same users).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from fedprivacy.privacy.clipping import clip_scale, l2_norm_bound  # pure torch: the clip every engine must apply

CLIENT_STREAM = 0x636C69656E74  # the trainer's data-order stream, so both loops see the same batches


def _load_(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Copy ``flat`` into the parameters (``vector_to_parameters`` would make them views of ``flat``)."""
    with torch.no_grad():
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(part.view_as(p))


def bare_next_word_dp_fedavg(model: torch.nn.Module, tokens: np.ndarray, starts: np.ndarray, stops: np.ndarray, *,
                             cohorts: list[np.ndarray], batch_size: int = 16, epochs: int = 1,
                             client_lr: float = 0.5, clip: float = 1.0, z: float = 1.0, server_lr: float = 1.0,
                             seed: int = 0) -> list[float]:
    """Run one round per entry of ``cohorts`` on ``model`` (trained in place); return each round's seconds."""
    params = list(model.parameters())
    noise_gen = torch.Generator().manual_seed(seed + 1)
    seconds = []
    for t, users in enumerate(cohorts, start=1):
        t0 = time.perf_counter()
        x_t = parameters_to_vector(params).detach().clone()
        total = torch.zeros_like(x_t)
        for u in users:
            rows = torch.from_numpy(np.asarray(tokens[int(starts[u]):int(stops[u])], dtype=np.int64))
            x, y = rows[:, :-1], rows[:, 1:]
            opt = torch.optim.SGD(params, lr=client_lr)
            rng = np.random.default_rng(np.random.SeedSequence([seed, CLIENT_STREAM, t, int(u)]))
            for _ in range(epochs):
                order = torch.from_numpy(rng.permutation(len(rows)))
                for lo in range(0, len(rows), batch_size):
                    idx = order[lo:lo + batch_size]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten(), ignore_index=0).backward()
                    opt.step()
            with torch.no_grad():
                delta = parameters_to_vector(params).sub_(x_t)
                total.add_(delta, alpha=clip_scale(l2_norm_bound(delta), clip))  # the same exact clip
            _load_(params, x_t)
        total.add_(torch.empty_like(total).normal_(0.0, z * clip, generator=noise_gen))
        _load_(params, x_t.add_(total, alpha=server_lr / len(users)))
        seconds.append(time.perf_counter() - t0)
    return seconds
