"""Server DiSK's defining properties on plain tensors (arXiv:2410.03883)."""

import pytest
import torch

from fedprivacy.optim.disk import DiskFilter, disk_coefficient, disk_combination
from fedprivacy.updates import SparseUpdate



@pytest.fixture(autouse=True)
def _float64():
    """Exactness checks in double precision, restored afterwards (other tests use float32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _quadratic(d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, d, generator=g)
    a = q @ q.T / d + 0.5 * torch.eye(d)
    b = torch.randn(d, generator=g)
    return a, b


def _disk_sgd(grad_at, kappa, gamma, lr, steps, x0, noise=None):
    """DiSK + SGD where 'clients' return gradients at x and at the lookahead (same sample)."""
    f = DiskFilter(kappa, gamma)
    x = x0.clone()
    tracked, xs = [], [x.clone()]
    for t in range(steps):
        ahead = f.lookahead(x)
        c = f.c
        g = grad_at(x, t) if ahead is None else c * grad_at(ahead, t) + (1 - c) * grad_at(x, t)
        if noise is not None:
            g = g + noise[t]
        gt = f.filter_(g).clone()
        tracked.append(gt)
        before = x.clone()
        x = x - lr * gt  # base optimizer: SGD on the (descent) gradient
        f.record_(x - before)
        xs.append(x.clone())
    return xs, tracked


@pytest.mark.parametrize("kappa,gamma", [(0.7, 0.5), (0.3, 2.0), (0.9, -1.0), (0.5, 1.0), (0.7, 3 / 7)])
def test_filter_tracks_the_true_gradient_exactly_on_noise_free_quadratics(kappa, gamma):
    a, b = _quadratic()
    xs, tracked = _disk_sgd(lambda x, t: a @ x - b, kappa, gamma, 0.1, 40, torch.ones(6))
    for x, gt in zip(xs[:-1], tracked):
        assert torch.allclose(gt, a @ x - b, atol=1e-12)


def test_kappa_one_is_the_base_optimizer_and_never_needs_a_lookahead():
    a, b = _quadratic()
    xs, _ = _disk_sgd(lambda x, t: a @ x - b + 0.01 * t, 1.0, 0.5, 0.1, 20, torch.ones(6))
    x = torch.ones(6)
    for t in range(20):
        x = x - 0.1 * (a @ x - b + 0.01 * t)
    assert torch.equal(xs[-1], x)
    f = DiskFilter(1.0, 0.5)
    f.record_(torch.ones(3))
    assert f.lookahead(torch.zeros(3)) is None and disk_coefficient(1.0, 0.5) == 0.0


def test_first_round_equals_the_base_optimizer():
    f = DiskFilter(0.7, 0.5)
    assert f.lookahead(torch.ones(4)) is None  # d_{-1} = 0: one pass from x_0
    g = torch.tensor([1.0, -2.0, 3.0, 0.5])
    assert torch.equal(f.filter_(g), g)  # g~_{-1} = g_0  =>  g~_0 = g_0


def test_gamma_minus_one_is_storm():
    # per-step sample-dependent quadratics f(x; xi_t), the same sample at both points
    d, kappa, lr = 5, 0.4, 0.05
    gen = torch.Generator().manual_seed(3)
    samples = [(torch.eye(d) * (1 + torch.rand(1, generator=gen)), torch.randn(d, generator=gen)) for _ in range(30)]

    def grad(x, t):
        a, b = samples[t]
        return a @ x - b

    xs, _ = _disk_sgd(grad, kappa, -1.0, lr, 30, torch.zeros(d))
    x_prev, x, v = None, torch.zeros(d), None
    for t in range(30):  # STORM: v_t = grad(x_t) + (1 - a)(v_{t-1} - grad(x_{t-1}))   (same xi_t)
        v = grad(x, t) if v is None else grad(x, t) + (1 - kappa) * (v - grad(x_prev, t))
        x_prev, x = x, x - lr * v
    assert torch.allclose(xs[-1], x, atol=1e-12)


def test_stationary_noise_variance_ratio_is_kappa_over_two_minus_kappa():
    kappa, sigma, d, steps = 0.7, 1.0, 20_000, 60
    gen = torch.Generator().manual_seed(0)
    f = DiskFilter(kappa, 0.5)
    true = torch.ones(d)
    for _ in range(steps):
        out = f.filter_(true + sigma * torch.randn(d, generator=gen))
    var = float(((out - true) ** 2).mean())
    expected = kappa / (2 - kappa) * sigma**2
    assert var == pytest.approx(expected, rel=0.03)  # s.e. of a variance over 20,000 coordinates ~1%


def test_combination_identity_and_single_pass_case():
    gen = torch.Generator().manual_seed(1)
    idx = torch.tensor([1, 4, 7])
    a, b = torch.randn(3, generator=gen), torch.randn(3, generator=gen)
    kappa, gamma = 0.7, 0.5
    c = disk_coefficient(kappa, gamma)
    u = disk_combination(SparseUpdate(idx, b, 9), SparseUpdate(idx, a, 9), c)
    # c b + (1 - c) a  ==  a + ((1 - kappa)/kappa) (b - a)/gamma
    assert torch.allclose(u.values, a + (1 - kappa) / kappa * (b - a) / gamma)
    assert torch.equal(u.indices, idx)
    only = SparseUpdate(idx, b, 9)
    assert disk_combination(only, None, 1.0) is only
    mixed = disk_combination(SparseUpdate(idx, b, 9), SparseUpdate(torch.tensor([0, 1]), torch.ones(2), 9), c)
    assert mixed.indices is None and torch.allclose(mixed.values[1], c * b[0] + (1 - c) * 1.0)


def test_state_round_trip():
    f = DiskFilter(0.6, 0.5)
    f.filter_(torch.ones(3))
    f.record_(torch.full((3,), 0.2))
    g = DiskFilter(0.6, 0.5)
    g.load_state_dict(f.state_dict())
    assert torch.equal(g.lookahead(torch.zeros(3)), f.lookahead(torch.zeros(3)))
    assert torch.equal(g.filter_(torch.zeros(3)), f.filter_(torch.zeros(3)))


def test_invalid_parameters_are_rejected():
    with pytest.raises(ValueError, match="kappa"):
        DiskFilter(0.0, 0.5)
    with pytest.raises(ValueError, match="gamma"):
        DiskFilter(0.5, 0.0)


def test_the_filtered_noise_variance_is_tracked_and_matches_monte_carlo():
    """V_t = Phi [(1-k)^(2t) + k/(2-k) (1 - (1-k)^(2t))] for a constant Phi: closed form and sampled."""
    kappa, phi, d = 0.7, 0.25, 400_000
    f = DiskFilter(kappa, 0.5)
    gen = torch.Generator().manual_seed(0)
    for t in range(10):
        out = f.filter_(torch.randn(d, generator=gen) * phi**0.5, phi)
        closed = phi * ((1 - kappa) ** (2 * t) + kappa / (2 - kappa) * (1 - (1 - kappa) ** (2 * t)))
        assert f.noise_variance == pytest.approx(closed, rel=1e-12)
        assert float(out.var()) == pytest.approx(closed, rel=0.01)
    assert f.noise_variance == pytest.approx(0.538 * phi, rel=0.01)  # ~0.54 Phi at kappa = 0.7


def test_dp_fedadambc_under_disk_subtracts_the_filtered_noise_variance(small_config):
    """The server's round under DiSK: g_t = s + N(0, Phi) per coordinate with s^2 = 0.09 Phi. After the
    filter, E[v_hat] = s^2 + V_t with V_t ~ 0.54 Phi; DP-FedAdamBC must subtract V_t, so v_hat - V_t
    estimates s^2 and few coordinates hit the floor (subtracting Phi floors every one of them)."""
    from fedprivacy.fl.server_app import DPFedAvgServer
    from fedprivacy.stackoverflow_tasks import load_task

    torch.set_default_dtype(torch.float32)  # the strategy's model travels as float32 (the fixture restores it)
    m, clip, s = 8, 100.0, 0.3  # |u| = 0.3 sqrt(d) = 95 < C: unclipped; z = 0.08 >= 2^-6
    z = m / clip  # Phi = (z C / m)^2 = 1
    cfg = small_config("server.optimizer=adambc", "server.lr=1e-6", "server.beta2=0.99", "server.gamma_prime=1e-6",
                       "server.disk.kappa=0.7", f"privacy.noise_multiplier={z}", f"privacy.clip_norm={clip}",
                       f"privacy.expected_cohort={m}")
    server = DPFedAvgServer(cfg, load_task(cfg.data)).strategy
    d = server.params.numel()
    for _ in range(300):
        agg = server.mechanism.aggregator(d)
        for _ in range(m):
            assert agg.add_(SparseUpdate.dense(torch.full((d,), s, dtype=torch.float32)))
        released = server.mechanism.release(agg, 1)
        server.post_process(released.g, released.phi)
    opt = server.optimizer
    shifted_square = opt._denominator(opt.v, opt.count) ** 2
    assert server.step.disk.noise_variance == pytest.approx(0.538, rel=0.01)
    assert float(shifted_square.mean()) == pytest.approx(s**2, rel=0.1)
    assert float((shifted_square <= 1e-6).float().mean()) < 0.4
