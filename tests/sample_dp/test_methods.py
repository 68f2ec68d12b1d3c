"""Each sample-level optimizer's defining property under Opacus (AdaDPS, DiSK, DP-MicroAdam,
DP-AdamBC): AdaDPS A=1 is DP-SGD and is scale invariant; DiSK kappa=1 is its base optimizer, its
two passes are combined before ONE clip and accounted as ONE step; DP-MicroAdam at density 1 is DP-Adam;
DP-AdamBC's second moment carries exactly Phi = (sigma C / B)^2 of noise."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedprivacy.client.sample_dp import run_sample_dp
from fedprivacy.optim.disk import DiskFilter
from fedprivacy.optim.sample_dp import FlatDescent, SampleDPConfig, make_base_optimizer
from sdp_helpers import (closure_for, dp_setup, flat_params, manual_per_sample_grads, per_record_loss, tiny_batch,
                         tiny_model)

BASE = SampleDPConfig(base="sgd", lr=0.5, noise_multiplier=1.0, clip_norm=0.5, batch_size=6)


def _data(n=40, dtype=torch.float64, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=dtype) * 3
    return TensorDataset(x, (x[:, 0] + 0.3 * torch.randn(n, generator=gen, dtype=dtype) > 0).long())


def _train(cfg, steps=6, dtype=torch.float64, **kwargs):
    model = tiny_model().to(dtype)
    run = run_sample_dp(model, _data(dtype=dtype), cfg, 11, steps=steps, loss_fn=per_record_loss, **kwargs)
    return flat_params(model), run


# -- AdaDPS ------------------------------------------------------------------------------------------


def test_adadps_with_unit_preconditioner_is_dp_sgd_bit_for_bit():
    ones = [torch.ones(p.shape, dtype=torch.float64) for p in tiny_model().parameters()]
    sgd, _ = _train(BASE)
    adadps, _ = _train(BASE, preconditioner=ones)
    assert torch.equal(sgd, adadps)


def test_adadps_scale_invariance_same_noise():
    gen = torch.Generator().manual_seed(9)
    a = [torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.2 for p in tiny_model().parameters()]
    c = 3.0
    scaled_a, _ = _train(BASE, preconditioner=[c * t for t in a])
    scaled_c, _ = _train(dataclasses.replace(BASE, clip_norm=c * BASE.clip_norm, lr=BASE.lr / c), preconditioner=a)
    plain, _ = _train(BASE, preconditioner=a)
    torch.testing.assert_close(scaled_a, scaled_c, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(scaled_a, plain)  # the equivalence is not vacuous


# -- DiSK --------------------------------------------------------------------------------------------


def _fixed_batch_run(disk, steps=4, clip_norm=0.5, sigma=1.0, lr=0.3):
    model = tiny_model()
    gsm, opt = dp_setup(model, lambda p: torch.optim.SGD(p, lr=lr), noise_multiplier=sigma, max_grad_norm=clip_norm,
                        expected_batch_size=8, disk=disk)
    x, y = tiny_batch(8)
    path = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        opt.step(closure_for(gsm, x, y))
        path.append(flat_params(model))
    return path


def test_disk_with_kappa_one_is_the_base_optimizer():
    base = _fixed_batch_run(None)
    disk = _fixed_batch_run(DiskFilter(kappa=1.0, gamma=0.5))
    assert all(torch.equal(a, b) for a, b in zip(base, disk))


def test_disk_combines_two_points_per_sample_before_one_clip():
    kappa, gamma, lr, clip_norm = 0.7, 0.5, 0.3, 0.4
    c = (1 - kappa) / (kappa * gamma)
    x1, x2 = _fixed_batch_run(DiskFilter(kappa, gamma), steps=2, clip_norm=clip_norm, sigma=0.0, lr=lr)
    model = tiny_model()
    x, y = tiny_batch(8)
    x0 = flat_params(model)

    def clipped_mean(rows):
        return (rows * torch.clamp(clip_norm / rows.norm(dim=1), max=1.0)[:, None]).mean(0)

    def grads_at(point):
        nn.utils.vector_to_parameters(point, model.parameters())
        return manual_per_sample_grads(model, x, y)

    g0 = clipped_mean(grads_at(x0))  # first step: one pass, g~_0 = g_0
    torch.testing.assert_close(x1, x0 - lr * g0, rtol=1e-12, atol=1e-12)
    combined = c * grads_at(x1 + gamma * (x1 - x0)) + (1 - c) * grads_at(x1)
    assert (combined.norm(dim=1) > clip_norm).any()  # the clip acts on the combination
    filtered = (1 - kappa) * g0 + kappa * clipped_mean(combined)
    torch.testing.assert_close(x2, x1 - lr * filtered, rtol=1e-12, atol=1e-12)


def test_disk_step_is_one_accountant_step():
    cfg = dataclasses.replace(BASE, disk_kappa=0.7, disk_gamma=0.5)
    _, run = _train(cfg, steps=5)
    _, plain = _train(BASE, steps=5)
    assert run.accountant.history == [(cfg.noise_multiplier, run.event.q, 5)]
    assert run.accountant.history == plain.accountant.history
    assert run.optimizer.disk.displacement is not None  # the lookahead was actually used


# -- DP-MicroAdam ------------------------------------------------------------------------------------


def test_microadam_at_density_one_is_dp_adam():
    adam_cfg = dataclasses.replace(BASE, base="adam", lr=0.05)
    micro_cfg = dataclasses.replace(adam_cfg, base="microadam", density=1.0, ring_size=10)
    adam, _ = _train(adam_cfg, dtype=torch.float32)
    micro, run = _train(micro_cfg, dtype=torch.float32)
    torch.testing.assert_close(micro, adam, rtol=1e-5, atol=1e-6)
    inner = run.optimizer.original_optimizer.inner
    assert inner.step == 6 and torch.count_nonzero(inner.error_codes) == 0  # no residual: EF stays zero


# -- DP-AdamBC ---------------------------------------------------------------------------------------


def test_adambc_phi_is_the_noise_variance_of_the_gradient_fed_to_adam():
    cfg = dataclasses.replace(BASE, base="adambc", batch_size=16, micro_batch_size=4)
    assert cfg.phi == pytest.approx((cfg.noise_multiplier * cfg.clip_norm / 4) ** 2)
    params = list(tiny_model().parameters())
    assert make_base_optimizer(params, cfg).inner.phi == cfg.phi


def test_adambc_bias_identity_under_opacus():
    """lr = 0 and one fixed batch: the clean mean g is constant, so E[v_hat_t] = g^2 + Phi exactly (Eq. 2)."""
    sigma, clip_norm, b, steps = 1.0, 1.0, 8, 10
    torch.manual_seed(0)
    model = nn.Linear(60, 20).double()
    x = torch.randn(b, 60, dtype=torch.float64)
    y = torch.arange(b) % 20
    cfg = SampleDPConfig(base="adambc", lr=0.0, noise_multiplier=sigma, clip_norm=clip_norm, batch_size=b,
                         beta2=0.9, gamma_prime=1e-12)
    gsm, opt = dp_setup(model, lambda p: make_base_optimizer(p, cfg), noise_multiplier=sigma, max_grad_norm=clip_norm,
                        expected_batch_size=b)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        opt.step(closure_for(gsm, x, y))
    inner: FlatDescent = opt.original_optimizer
    v_hat = inner.inner.v / (1 - cfg.beta2**steps)
    rows = manual_per_sample_grads(model, x, y)
    clean = (rows * torch.clamp(clip_norm / rows.norm(dim=1), max=1.0)[:, None]).sum(0) / b
    excess = ((v_hat - clean**2) / cfg.phi).mean()
    assert excess == pytest.approx(1.0, abs=0.08)  # std of this mean ~ 0.016 (arXiv:2312.14334)


def test_adambc_under_disk_subtracts_the_filtered_noise_variance():
    """As above with DiSK (kappa = 0.7): Adam sees the filtered gradient, whose noise variance is
    V_t = Phi [(1-k)^(2t) + k/(2-k)(1 - (1-k)^(2t))] (about 0.54 Phi), not Phi. The optimizer's
    bias term must be the EMA of V_t, and it must match the measured excess of v_hat over clean^2."""
    sigma, clip_norm, b, steps, kappa = 1.0, 1.0, 8, 10, 0.7
    torch.manual_seed(0)
    model = nn.Linear(200, 20).double()
    x = torch.randn(b, 200, dtype=torch.float64)
    y = torch.arange(b) % 20
    cfg = SampleDPConfig(base="adambc", lr=0.0, noise_multiplier=sigma, clip_norm=clip_norm, batch_size=b,
                         beta2=0.9, gamma_prime=1e-12, disk_kappa=kappa, disk_gamma=0.5)
    gsm, opt = dp_setup(model, lambda p: make_base_optimizer(p, cfg), noise_multiplier=sigma, max_grad_norm=clip_norm,
                        expected_batch_size=b, disk=DiskFilter(kappa, 0.5))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        opt.step(closure_for(gsm, x, y))
    inner = opt.original_optimizer.inner
    t = steps - 1
    assert inner.phi == pytest.approx(cfg.phi * ((1 - kappa) ** (2 * t) + kappa / (2 - kappa) * (1 - (1 - kappa) ** (2 * t))))
    correction = 1 - cfg.beta2**steps
    rows = manual_per_sample_grads(model, x, y)
    clean = (rows * torch.clamp(clip_norm / rows.norm(dim=1), max=1.0)[:, None]).sum(0) / b
    excess = (inner.v / correction - clean**2).mean()
    assert inner.phi_ema / correction < 0.75 * cfg.phi  # well below Phi: subtracting Phi would over-correct
    assert excess / (inner.phi_ema / correction) == pytest.approx(1.0, abs=0.1)


def test_secure_noise_also_makes_the_record_sampling_secret():
    """Amplification by sampling assumes the server cannot know which records a step used: with
    ``secure_noise`` the Poisson batches (not only the noise) come from the OS, so two runs from the same
    seed differ even without noise; seeded runs are reproducible."""
    cfg = dataclasses.replace(BASE, noise_multiplier=0.0)
    seeded = [_train(cfg)[0] for _ in range(2)]
    secure = [_train(cfg, secure_noise=True)[0] for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1])
    assert not torch.equal(secure[0], secure[1])
