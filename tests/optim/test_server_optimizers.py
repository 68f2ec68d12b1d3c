"""Server optimizers' defining properties on plain tensors.

FedAdam/FedYogi/FedAdagrad: Reddi et al., arXiv:2003.00295v5, Alg. 2; bias correction: Kingma & Ba,
arXiv:1412.6980, Alg. 1. DP-FedAdamBC: Tang et al., arXiv:2312.14334v1, Eq. (2), (4), Alg. 1, and
the testable statements of DP-AdamBC (arXiv:2312.14334). Exactness checks run in float64.
"""

import io
import math

import pytest
import torch

from fedprivacy.optim.adambc import ServerAdamBC
from fedprivacy.privacy.placement import dp_noise_variance
from fedprivacy.optim.factory import make_server_optimizer
from fedprivacy.optim.fedopt import ServerAdagrad, ServerAdam, ServerYogi
from fedprivacy.optim.server_sgd import ServerSGD

F64 = torch.float64


def vec(*xs: float, dtype=F64) -> torch.Tensor:
    return torch.tensor(xs, dtype=dtype)


def run(opt, gs, x0=None):
    """Apply every ``g`` in ``gs``; return the params after each step."""
    x = torch.zeros_like(gs[0]) if x0 is None else x0.clone()
    out = []
    for g in gs:
        opt.step_(x, g)
        out.append(x.clone())
    return out


# -- FedAdam ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, rtol", [(F64, 1e-13), (torch.float32, 2e-6)])
def test_adam_first_step_with_bias_correction_is_g_over_abs_g_plus_tau(dtype, rtol):
    g = vec(3.0, -0.5, 1e-4, 0.0, -20.0, 7e-3, dtype=dtype)
    lr, tau = 0.1, 1e-3
    (x,) = run(ServerAdam(lr, beta1=0.9, beta2=0.99, tau=tau, bias_correction=True), [g])
    torch.testing.assert_close(x, lr * g / (g.abs() + tau), rtol=rtol, atol=0.0)


def test_adam_first_step_without_bias_correction():
    g = vec(3.0, -0.5, 1e-4, 0.0, -20.0)
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    (x,) = run(ServerAdam(lr, beta1=b1, beta2=b2, tau=tau), [g])
    torch.testing.assert_close(x, lr * (1 - b1) * g / (math.sqrt(1 - b2) * g.abs() + tau), rtol=1e-13, atol=0.0)


def test_adam_constant_g_bias_corrected_takes_the_same_step_every_round():
    g = vec(2.0, -0.3, 5e-3)
    lr, tau = 0.2, 1e-3
    xs = run(ServerAdam(lr, beta1=0.9, beta2=0.99, tau=tau, bias_correction=True), [g] * 10)
    steps = torch.diff(torch.stack([torch.zeros_like(g)] + xs), dim=0)
    torch.testing.assert_close(steps, (lr * g / (g.abs() + tau)).expand(10, -1), rtol=1e-12, atol=0.0)


def test_adam_constant_g_uncorrected_moments_approach_g_and_g_squared():
    g = vec(2.0, -0.3, 5e-3)
    lr, b1, b2, tau = 0.2, 0.9, 0.99, 1e-3
    opt = ServerAdam(lr, beta1=b1, beta2=b2, tau=tau)
    xs = run(opt, [g] * 2000)
    state = opt.state_dict()
    assert state["count"] == 2000
    torch.testing.assert_close(state["m"], (1 - b1**2000) * g, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(state["v"], (1 - b2**2000) * g * g, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(xs[-1] - xs[-2], lr * g / (g.abs() + tau), rtol=1e-8, atol=0.0)


# -- FedYogi and FedAdagrad, two steps by hand ---------------------------------------------------
def test_yogi_two_steps_by_hand():
    # b1 = 0.5, b2 = 0.75, tau = 0.5, lr = 1, v0 = 0.
    # step 1: m = [1, -0.5, 1], v = 0.25 g1^2 = [1, 0.25, 1] (sign(0 - g^2) = -1)
    # step 2: m = [1, 1.25, 0.75]; v - g2^2 = [0, -8.75, 0.75] -> sign [0, -1, +1]
    #         v = [1, 0.25 + 0.25 * 9, 1 - 0.25 * 0.25] = [1, 2.5, 0.9375]   (Adam: [1, 2.4375, 0.8125])
    g1, g2 = vec(2.0, -1.0, 2.0), vec(1.0, 3.0, 0.5)
    opt = ServerYogi(1.0, beta1=0.5, beta2=0.75, tau=0.5)
    x1, x2 = run(opt, [g1, g2])
    torch.testing.assert_close(x1, vec(1 / 1.5, -0.5 / 1.0, 1 / 1.5), rtol=1e-14, atol=0.0)
    step2 = vec(1 / 1.5, 1.25 / (math.sqrt(2.5) + 0.5), 0.75 / (math.sqrt(0.9375) + 0.5))
    torch.testing.assert_close(x2, x1 + step2, rtol=1e-14, atol=0.0)
    torch.testing.assert_close(opt.state_dict()["v"], vec(1.0, 2.5, 0.9375), rtol=0.0, atol=0.0)


def test_yogi_constant_g_squared_is_a_fixed_point_of_v():
    # v grows by (1 - b2) g^2 = g^2 / 4 per step until it equals g^2, where sign(0) = 0 stops it.
    g = vec(2.0, -0.5)
    opt = ServerYogi(0.1, beta1=0.9, beta2=0.75, tau=1e-3)
    for t in range(1, 11):
        opt.step_(torch.zeros_like(g), g)
        assert torch.equal(opt.state_dict()["v"], min(t, 4) / 4 * g * g)


def test_adagrad_two_steps_by_hand():
    # beta1 = 0, tau = 0.5, v0 = 0: v1 = [4, 1], v2 = [5, 10].
    g1, g2 = vec(2.0, -1.0), vec(1.0, 3.0)
    x1, x2 = run(ServerAdagrad(1.0, tau=0.5), [g1, g2])
    torch.testing.assert_close(x1, vec(2 / 2.5, -1 / 1.5), rtol=1e-14, atol=0.0)
    torch.testing.assert_close(x2 - x1, vec(1 / (math.sqrt(5) + 0.5), 3 / (math.sqrt(10) + 0.5)), rtol=1e-14, atol=0.0)


def test_adagrad_with_momentum_and_initial_accumulator_by_hand():
    # beta1 = 0.5, v0 = 1: m1 = [1, -0.5], v1 = [5, 2]; m2 = [1, 1.25], v2 = [6, 11].
    g1, g2 = vec(2.0, -1.0), vec(1.0, 3.0)
    x1, x2 = run(ServerAdagrad(1.0, beta1=0.5, tau=0.5, initial_accumulator=1.0), [g1, g2])
    torch.testing.assert_close(x1, vec(1 / (math.sqrt(5) + 0.5), -0.5 / (math.sqrt(2) + 0.5)), rtol=1e-14, atol=0.0)
    torch.testing.assert_close(x2 - x1, vec(1 / (math.sqrt(6) + 0.5), 1.25 / (math.sqrt(11) + 0.5)), rtol=1e-14, atol=0.0)


def test_adagrad_constant_g_step_shrinks_as_one_over_sqrt_t():
    g = vec(2.0, -0.5)
    lr, tau = 0.1, 1e-3
    xs = run(ServerAdagrad(lr, tau=tau), [g] * 9)
    for t in (1, 4, 9):
        step = xs[t - 1] - (xs[t - 2] if t > 1 else torch.zeros_like(g))
        torch.testing.assert_close(step, lr * g / (math.sqrt(t) * g.abs() + tau), rtol=1e-13, atol=0.0)


# -- contract: every optimizer the factory builds -------------------------------------------------
CONFIGS = {
    "sgd": dict(momentum=0.9),
    "adam": dict(bias_correction=True),
    "yogi": dict(),
    "adagrad": dict(),
    "adagrad-momentum": dict(beta1=0.5),
    "adambc": dict(phi=0.04, gamma_prime=1e-3),
    "adambc-uncorrected": dict(phi=0.04, gamma_prime=1e-3, bias_correction=False),
}


def build(key: str):
    return make_server_optimizer(key.split("-")[0], lr=0.05, **CONFIGS[key])


@pytest.mark.parametrize("key", list(CONFIGS))
def test_resume_from_a_saved_state_equals_an_uninterrupted_run_bit_for_bit(key):
    gen = torch.Generator().manual_seed(7)
    gs = [0.3 * torch.randn(1000, generator=gen) for _ in range(6)]
    x0 = torch.randn(1000, generator=gen)

    uninterrupted = run(build(key), gs, x0)[-1]

    first = build(key)
    x = run(first, gs[:3], x0)[-1]
    buf = io.BytesIO()
    torch.save({"params": x, "optimizer": first.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = build(key)
    resumed.load_state_dict(ckpt["optimizer"])
    assert torch.equal(run(resumed, gs[3:], ckpt["params"])[-1], uninterrupted)


@pytest.mark.parametrize("key", list(CONFIGS))
def test_step_neither_mutates_nor_aliases_its_input(key):
    gen = torch.Generator().manual_seed(3)
    opt, x = build(key), torch.zeros(50)
    for _ in range(2):
        g = torch.randn(50, generator=gen)
        g_before = g.clone()
        opt.step_(x, g)
        assert torch.equal(g, g_before)
        snapshot = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state_dict().items()}
        g.mul_(100.0)  # the caller (e.g. the DiSK filter) reuses its buffer
        after = opt.state_dict()
        assert all(torch.equal(after[k], v) if torch.is_tensor(v) else after[k] == v for k, v in snapshot.items())


def test_state_dict_is_a_snapshot_and_refuses_another_kind():
    opt = ServerAdam(0.1)
    opt.step_(torch.zeros(3), vec(1.0, 2.0, 3.0, dtype=torch.float32))
    state = opt.state_dict()
    state["m"].fill_(99.0)
    assert not torch.equal(opt.state_dict()["m"], state["m"])
    with pytest.raises(ValueError, match="ServerAdam"):
        ServerYogi(0.1).load_state_dict(opt.state_dict())


# -- DP-FedAdamBC -----------------------------------------------------------------------------------
def test_dp_bias_of_the_second_moment_is_phi_after_bias_correction_monte_carlo():
    """notes §2.8 item 2: E[v_hat^p] = v_hat^c + Phi; E[v^p] = v^c + (1 - b2^t) Phi (fixed clean sequence)."""
    n, t, b2, phi = 200_000, 25, 0.9, 0.09
    clean = [0.5 * math.sin(k) + 0.2 for k in range(1, t + 1)]
    gen = torch.Generator().manual_seed(11)
    opt = ServerAdamBC(0.0, phi=phi, gamma_prime=1e-6, beta2=b2)
    x = torch.zeros(n, dtype=F64)
    for c in clean:
        opt.step_(x, c + math.sqrt(phi) * torch.randn(n, generator=gen, dtype=F64))
    v = opt.state_dict()["v"]
    weights = [(1 - b2) * b2 ** (t - k) for k in range(1, t + 1)]
    v_clean = sum(w * c * c for w, c in zip(weights, clean))
    var = sum((w * w) * (4 * c * c * phi + 2 * phi * phi) for w, c in zip(weights, clean))
    tol = 5 * math.sqrt(var / n)  # std of the mean of n independent v^p, uncorrected scale
    bc = 1 - b2**t
    assert abs(float(v.mean()) - (v_clean + bc * phi)) < tol
    assert abs(float((v / bc).mean()) - (v_clean / bc + phi)) < tol / bc
    assert abs(float((v / bc).mean()) - v_clean / bc) > 10 * tol / bc  # the bias itself is resolved
    assert abs(float(v.mean()) - (v_clean + phi)) > 10 * tol  # and (1 - b2^t) Phi is not Phi


@pytest.mark.parametrize("corrected", [True, False])
def test_time_varying_phi_ema_removes_the_bias_in_expectation(corrected):
    """notes §5: with per-round noise variance Phi_t (adaptive clipping moves C_t) the bias of v is the
    EMA of the Phi_t: on pure noise (clean g = 0) the shifted moment has mean 0, and a constant-Phi
    correction would not."""
    n, b2 = 200_000, 0.8
    phis = [0.01 * (1 + k % 3) ** 2 for k in range(12)]
    gen = torch.Generator().manual_seed(3)
    opt = ServerAdamBC(0.0, phi=phis[0], gamma_prime=1e-9, beta2=b2, corrected_v=corrected)
    x = torch.zeros(n, dtype=F64)
    for phi in phis:
        opt.set_phi(phi)
        opt.step_(x, math.sqrt(phi) * torch.randn(n, generator=gen, dtype=F64))
    t = len(phis)
    ema = sum((1 - b2) * b2 ** (t - k) * phi for k, phi in enumerate(phis, start=1))
    assert opt.phi_ema == pytest.approx(ema, rel=1e-12)
    scale = 1 - b2**t if corrected else 1.0
    v = opt.state_dict()["v"] / scale
    shifted = v - opt.phi_ema / scale
    sd = float(v.std()) / math.sqrt(n)
    assert abs(float(shifted.mean())) < 5 * sd
    assert abs(float((v - phis[-1]).mean())) > 10 * sd  # the last round's Phi alone is the wrong bias


@pytest.mark.parametrize("corrected", [True, False])
def test_step_subtracts_the_ema_of_the_per_round_phi(corrected):
    """Two steps by hand with Phi_1 != Phi_2: the denominator uses Phi-bar_2, not Phi_2."""
    b1, b2, lr, gp = 0.5, 0.8, 0.1, 1e-9
    g1, g2, phi1, phi2 = 1.0, -2.0, 0.3, 0.05
    opt = ServerAdamBC(lr, phi=phi1, gamma_prime=gp, beta1=b1, beta2=b2, corrected_v=corrected)
    x = torch.zeros(1, dtype=F64)
    opt.step_(x, torch.tensor([g1], dtype=F64))
    x1 = float(x)
    opt.set_phi(phi2)
    opt.step_(x, torch.tensor([g2], dtype=F64))
    m = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v = b2 * (1 - b2) * g1**2 + (1 - b2) * g2**2
    phi_bar = b2 * (1 - b2) * phi1 + (1 - b2) * phi2
    if corrected:
        step = lr * (m / (1 - b1**2)) / math.sqrt(max(v / (1 - b2**2) - phi_bar / (1 - b2**2), gp))
    else:
        step = lr * m / math.sqrt(max(v - phi_bar, gp))
    assert float(x) - x1 == pytest.approx(step, rel=1e-12)


def test_constant_phi_ema_is_the_closed_form_bias():
    opt = ServerAdamBC(0.1, phi=0.04, gamma_prime=1e-3, beta2=0.99)
    x = torch.zeros(10, dtype=F64)
    for t in range(1, 30):
        opt.step_(x, torch.ones(10, dtype=F64))
        assert opt.phi_ema == pytest.approx((1 - 0.99**t) * 0.04, rel=1e-12)


@pytest.mark.parametrize("corrected", [True, False])
def test_adambc_with_zero_phi_and_vanishing_gamma_is_adam_without_epsilon(corrected):
    gen = torch.Generator().manual_seed(5)
    gs = [torch.randn(200, generator=gen, dtype=F64) for _ in range(5)]
    bc = run(ServerAdamBC(0.1, phi=0.0, gamma_prime=1e-300, beta2=0.99, corrected_v=corrected), gs)[-1]
    adam = run(ServerAdam(0.1, beta2=0.99, tau=1e-300, bias_correction=corrected), gs)[-1]
    torch.testing.assert_close(bc, adam, rtol=1e-13, atol=0.0)


def test_adambc_clamp_semantics_first_step():
    # t = 1: m_hat = g, v_hat = g^2; v_hat - Phi = [-0.75, ~0, 0.0201, 3, 8, -1] -> max(., 0.04).
    g = vec(0.5, 1.0, 1.01, 2.0, -3.0, 0.0)
    lr, phi, gp = 0.5, 1.0, 0.04
    (x,) = run(ServerAdamBC(lr, phi=phi, gamma_prime=gp), [g])
    denom = vec(0.2, 0.2, 0.2, math.sqrt(3.0), math.sqrt(8.0), 0.2)  # no "+ eps", never sqrt(4) - sqrt(1)
    torch.testing.assert_close(x, lr * g / denom, rtol=1e-13, atol=0.0)
    assert bool((x.abs() <= lr * g.abs() / math.sqrt(gp) * (1 + 1e-15)).all())


def test_adambc_two_steps_by_hand_both_variants():
    # b1 = 0.5, b2 = 0.75, Phi = 1, gamma' = 0.01, lr = 1; g1 = [2, 1], g2 = [2, 0.5].
    # moments: m1 = [1, 0.5], v1 = [1, 0.25]; m2 = [1.5, 0.5], v2 = [1.75, 0.25].
    # corrected:   v_hat - Phi = [3, 0] then [3, -0.43]; m_hat = [2, 1] then [2, 2/3].
    # uncorrected: v - (1 - b2^t) Phi = [0.75, 0] then [1.3125, -0.1875]; m as is.
    g1, g2 = vec(2.0, 1.0), vec(2.0, 0.5)
    kw = dict(phi=1.0, gamma_prime=0.01, beta1=0.5, beta2=0.75)
    _, xc = run(ServerAdamBC(1.0, **kw), [g1, g2])
    torch.testing.assert_close(xc, vec(4 / math.sqrt(3.0), 10.0 + (2 / 3) / 0.1), rtol=1e-13, atol=0.0)
    _, xu = run(ServerAdamBC(1.0, corrected_v=False, **kw), [g1, g2])
    torch.testing.assert_close(xu, vec(1 / math.sqrt(0.75) + 1.5 / math.sqrt(1.3125), 10.0), rtol=1e-13, atol=0.0)


def test_adambc_constant_g_takes_the_debiased_sign_step():
    g = vec(2.0, -0.7)  # g^2 - Phi > gamma' everywhere
    lr, phi = 0.1, 0.25
    xs = run(ServerAdamBC(lr, phi=phi, gamma_prime=1e-4), [g] * 6)
    steps = torch.diff(torch.stack([torch.zeros_like(g)] + xs), dim=0)
    torch.testing.assert_close(steps, (lr * g / (g * g - phi).sqrt()).expand(6, -1), rtol=1e-12, atol=0.0)


def test_constant_denominator_adam_is_sgd_with_momentum_on_a_schedule():
    """notes §2.8 item 5 (paper Eq. 3): m_hat / const == SGDM with lr_t = lr (1-b)/((1-b^t) sqrt(const)).

    Every coordinate clamped (Phi far above v_hat) makes AdamBC's denominator the constant
    sqrt(gamma'), i.e. the oracle "v_hat replaced by a constant"; it must match heavy-ball SGD.
    """
    gen = torch.Generator().manual_seed(9)
    gs = [0.2 * torch.randn(300, generator=gen, dtype=F64) for _ in range(30)]
    lr, b1, gp = 1e-3, 0.9, 2.44140625e-8
    adam_xs = run(ServerAdamBC(lr, phi=1e6, gamma_prime=gp, beta1=b1), gs)
    sgd, x = ServerSGD(lr=0.0, momentum=b1), torch.zeros(300, dtype=F64)
    for t, (g, want) in enumerate(zip(gs, adam_xs), start=1):
        sgd.lr = lr * (1 - b1) / ((1 - b1**t) * math.sqrt(gp))  # 6.4 at t = 1, -> 0.64
        sgd.step_(x, g)
        torch.testing.assert_close(x, want, rtol=1e-10, atol=1e-18)


def test_noise_dominated_dp_adam_is_close_to_sgd_with_momentum():
    """notes §2.2 / §2.8 item 6: clean signal 0, t >> 1/(1-b2): v_hat ~ Phi, so DP-Adam's step is
    SGDM's with lr_t = lr (1-b1)/((1-b1^t) sqrt(Phi)), within the v_hat fluctuation (std ~0.1 Phi)."""
    n, steps, b1, b2, phi, lr = 20_000, 400, 0.9, 0.99, 1e-4, 1e-3
    gen = torch.Generator().manual_seed(13)
    adam, sgd = ServerAdam(lr, beta1=b1, beta2=b2, tau=1e-12, bias_correction=True), ServerSGD(0.0, momentum=b1)
    xa, xs = torch.zeros(n, dtype=F64), torch.zeros(n, dtype=F64)
    for t in range(1, steps + 1):
        g = math.sqrt(phi) * torch.randn(n, generator=gen, dtype=F64)
        before_a, before_s = xa.clone(), xs.clone()
        adam.step_(xa, g)
        sgd.lr = lr * (1 - b1) / ((1 - b1**t) * math.sqrt(phi))
        sgd.step_(xs, g)
    ratio = (xa - before_a) / (xs - before_s)  # = sqrt(Phi / v_hat) per coordinate
    assert abs(float(ratio.median()) - 1.0) < 0.02
    lo, hi = torch.quantile(ratio, torch.tensor([0.005, 0.995], dtype=F64)).tolist()
    assert 0.8 < lo < 1.0 < hi < 1.25


@pytest.mark.parametrize("z, c, m, phi", [
    (0.4, 0.1, 256, 2.44140625e-8), (1.0, 1.0, 256, 1.52587890625e-5), (2.0, 1.0, 8192, 5.9604644775390625e-8),
    (1.0, 1.0, 2048, 2.384185791015625e-7), (0.5, 0.1, 256, 3.814697265625e-8), (0.0, 10.0, 100, 0.0),
])
def test_dp_noise_variance_values(z, c, m, phi):
    assert dp_noise_variance(z, c, m) == pytest.approx(phi, rel=1e-14, abs=0.0)


@pytest.mark.parametrize("args, field", [((-1.0, 1.0, 10), "noise_multiplier"), ((1.0, 0.0, 10), "clip_norm"),
                                         ((1.0, 1.0, 0), "expected_cohort")])
def test_dp_noise_variance_rejects_bad_input(args, field):
    with pytest.raises(ValueError, match=field):
        dp_noise_variance(*args)


# -- construction -----------------------------------------------------------------------------------
def test_factory_builds_each_optimizer_with_the_papers_defaults():
    assert isinstance(make_server_optimizer("sgd", lr=1.0), ServerSGD)
    adam = make_server_optimizer("adam", lr=0.1, beta2=0.9)
    assert type(adam) is ServerAdam and adam.beta2 == 0.9 and adam.bias_correction is False
    assert type(make_server_optimizer("yogi", lr=0.1)) is ServerYogi
    assert make_server_optimizer("adagrad", lr=0.1, tau=0.5).tau == 0.5
    bc = make_server_optimizer("adambc", lr=0.1, phi=1e-6, gamma_prime=1e-8)
    assert type(bc) is ServerAdamBC and bc.corrected_v is True and bc.bias_correction is True
    assert make_server_optimizer("adambc", lr=0.1, phi=1e-6, gamma_prime=1e-8, bias_correction=False).corrected_v is False
    assert make_server_optimizer("adambc", lr=0.1, phi=0.04).gamma_prime == pytest.approx(4e-4)  # 0.01 Phi
    assert make_server_optimizer("adambc", lr=0.1, phi=0.0).gamma_prime == 1e-12


@pytest.mark.parametrize("name, kwargs, match", [
    ("adam", dict(momentum=0.9), "does not use momentum"),
    ("adambc", dict(phi=1e-6, gamma_prime=1e-8, tau=1e-3), "does not use tau"),
    ("adagrad", dict(bias_correction=True), "does not use bias_correction"),
    ("sgd", dict(beta1=0.9), "does not use beta1"),
    ("adambc", dict(gamma_prime=1e-8), "requires phi"),
    ("rmsprop", dict(), "unknown server optimizer"),
])
def test_factory_refuses_settings_it_would_drop(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_server_optimizer(name, lr=0.1, **kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: ServerAdam(0.1, bias_correction=True, initial_accumulator=1e-6), "initial_accumulator"),
    (lambda: ServerAdam(0.1, tau=0.0), "tau"),
    (lambda: ServerYogi(0.1, beta2=1.0), "beta2"),
    (lambda: ServerAdagrad(0.1, beta1=-0.1), "beta1"),
    (lambda: ServerAdamBC(0.1, phi=1e-6, gamma_prime=0.0), "gamma_prime"),
    (lambda: ServerAdamBC(0.1, phi=-1.0, gamma_prime=1e-8), "phi"),
])
def test_constructors_reject_bad_settings(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_step_rejects_a_pseudo_gradient_of_another_shape():
    with pytest.raises(ValueError, match="shape"):
        ServerAdam(0.1).step_(torch.zeros(3), torch.zeros(4))


def test_adambc_reports_the_share_of_coordinates_floored_at_gamma_prime():
    opt = ServerAdamBC(0.1, phi=1.0, gamma_prime=0.01, beta2=0.99)
    g = torch.tensor([0.0, 0.1, 10.0, 20.0])  # v_hat = g^2: 0, 0.01, 100, 400; minus Phi = 1
    opt.step_(torch.zeros(4), g)
    assert opt.floored_fraction == pytest.approx(0.5)
    opt.set_phi(1e6)
    opt.step_(torch.zeros(4), g)
    assert opt.floored_fraction == 1.0
