"""DiSK's stationary noise reduction kappa/(2-kappa) (Zhang et al. 2024, arXiv:2410.03883, Alg. 3), sample level.

A least-squares problem F(x) = (1/2n) ||X x - y||^2 trained with DiSK + SGD through the record-level
optimizer (Opacus per-sample gradients, two passes per step, one clip, one noise draw). Every record
is used every step (q = 1) and the clip is inactive, so each step observes g_t = grad F(x_t) +
c gamma H d_{t-1} + w_t with w_t ~ N(0, sigma_DP^2 I), sigma_DP = sigma C / n. Because the gradient
is linear, the filter's error e_t = grad F(x_t) - g~_t obeys e_t = (1-kappa) e_{t-1} - kappa w_t
exactly, whatever the trajectory and gamma, so its stationary variance per coordinate is

    E[e^2] / sigma_DP^2 = kappa / (2 - kappa)      (0.5385 at the paper's kappa = 0.7; 1 for DP-SGD)

(arXiv:2410.03883: the noise-variance reduction factor, the paper's Lemma 1 with
L = 0). The paper states no number for it; we print the measured ratio beside the prediction.

    python simulations/disk_noise_ratio.py [--steps 400] [--dim 2000]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedprivacy.centralized import train_centralized
from fedprivacy.optim.sample_dp import SampleDPConfig, SampleDPOptimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--burn-in", type=int, default=50)
    parser.add_argument("--dim", type=int, default=2000)
    parser.add_argument("--records", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    n, d = args.records, args.dim
    x_data = torch.randn(n, d, generator=gen, dtype=torch.float64) / d**0.5
    y_data = x_data @ torch.randn(d, generator=gen, dtype=torch.float64)
    sigma, clip_norm = 1e-4, 1e6  # sigma C = 100: strong noise, clip never active (||per-sample grad|| << C)
    sigma_dp = sigma * clip_norm / n

    def true_gradient(w: torch.Tensor) -> torch.Tensor:
        return x_data.T @ (x_data @ w - y_data) / n

    print(f"d = {d}, n = {n} (q = 1), sigma_DP = {sigma_dp:.4g}, gamma = 0.5, SGD lr = 0.5")
    print(f"{'kappa':>6s}{'measured':>11s}{'kappa/(2-kappa)':>17s}")
    for kappa in (0.3, 0.5, 0.7, 0.9, 1.0):
        model = nn.Linear(d, 1, bias=False).double()
        nn.init.zeros_(model.weight)
        previous = [model.weight.detach().reshape(-1).clone()]
        errors = []

        def record(t: int, optimizer: SampleDPOptimizer) -> None:
            filtered = model.weight.grad.reshape(-1)  # what the base step used: g~_t (g_t at kappa = 1)
            if t > args.burn_in:
                errors.append(float(((true_gradient(previous[0]) - filtered) ** 2).mean()))
            previous[0] = model.weight.detach().reshape(-1).clone()

        cfg = SampleDPConfig(base="sgd", lr=0.5, noise_multiplier=sigma, clip_norm=clip_norm, batch_size=n,
                             disk_kappa=kappa, disk_gamma=0.5)
        train_centralized(model, TensorDataset(x_data, y_data), cfg, seed=1, steps=args.steps, target_delta=1e-5,
                          loss_fn=lambda out, y: 0.5 * (out.squeeze(-1) - y) ** 2, on_step=record)
        measured = sum(errors) / len(errors) / sigma_dp**2
        print(f"{kappa:6.2f}{measured:11.4f}{kappa / (2 - kappa):17.4f}")


if __name__ == "__main__":
    main()
