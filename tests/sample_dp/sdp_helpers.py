"""Helpers for the sample-level DP tests: tiny float64 models, fixed batches, manual per-sample grads."""

import torch
from opacus import GradSampleModule
from torch import nn

from fedprivacy.optim.sample_dp import SampleDPOptimizer


def tiny_model(seed: int = 0, d_in: int = 4, hidden: int = 3, d_out: int = 2) -> nn.Module:
    torch.manual_seed(seed)  # model init only; the DP code never touches the global RNG
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).double()


def tiny_batch(n: int = 8, d_in: int = 4, d_out: int = 2, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=gen, dtype=torch.float64) * 3, torch.randint(0, d_out, (n,), generator=gen)


def per_record_loss(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def closure_for(gsm, x, y):
    def closure():
        per_record_loss(gsm(x), y).sum().backward()
    return closure


def manual_per_sample_grads(model: nn.Module, x, y) -> torch.Tensor:
    """Each record's flat gradient (rows), by plain autograd one record at a time."""
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        per_record_loss(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    model.zero_grad()
    return torch.stack(rows)


def dp_setup(model: nn.Module, base_factory, **kwargs):
    """(GradSampleModule, SampleDPOptimizer) with base ``base_factory(params)`` and a seeded noise generator."""
    gsm = GradSampleModule(model, loss_reduction="sum")
    params = list(gsm.parameters())
    kwargs.setdefault("generator", torch.Generator().manual_seed(123))
    return gsm, SampleDPOptimizer(base_factory(params), **kwargs)


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])
