"""ServerStep: the one post-processing step of the server and the strategy (DiSK, Phi, optimizer)."""

import copy

import pytest
import torch

from fedprivacy.optim.adambc import ServerAdamBC
from fedprivacy.optim.disk import DiskFilter
from fedprivacy.optim.factory import make_server_optimizer
from fedprivacy.optim.server_step import ServerStep


def _gs(n: int = 4, d: int = 50) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(d, generator=gen) for _ in range(n)]


def test_without_disk_it_is_the_optimizer_alone_and_kappa_one_changes_nothing():
    results = []
    for disk in (None, DiskFilter(1.0, 0.5)):
        step, x = ServerStep(make_server_optimizer("adam", lr=0.1, tau=1e-3), disk), torch.zeros(50)
        for g in _gs():
            step.apply_(x, g, 0.01)
        results.append(x)
    opt, x = make_server_optimizer("adam", lr=0.1, tau=1e-3), torch.zeros(50)
    for g in _gs():
        opt.step_(x, g)
    assert torch.equal(results[0], x) and torch.equal(results[1], x)


def test_disk_feeds_the_filtered_gradient_and_its_variance_and_records_the_actual_move():
    """kappa = 0.5: g~_1 = g_1, g~_2 = (g_1 + g_2) / 2; V_2 = 0.25 Phi + 0.25 Phi = 0.5 Phi."""
    opt = ServerAdamBC(0.1, phi=1.0, gamma_prime=1e-6)
    step, x = ServerStep(opt, DiskFilter(0.5, 0.5)), torch.zeros(50)
    g1, g2 = _gs(2)
    step.apply_(x, g1, 0.04)
    assert opt.phi == pytest.approx(0.04)
    before = x.clone()
    step.apply_(x, g2, 0.04)
    assert opt.phi == pytest.approx(0.02) and torch.equal(step.disk.filtered, (g1 + g2) / 2)
    torch.testing.assert_close(step.disk.displacement, x - before)
    torch.testing.assert_close(step.lookahead(x), x + 0.5 * (x - before))


def test_state_dict_round_trip_resumes_exactly():
    def fresh():
        return ServerStep(make_server_optimizer("adam", lr=0.1, tau=1e-3), DiskFilter(0.7, 0.5))
    a, x = fresh(), torch.zeros(50)
    g1, g2, g3 = _gs(3)
    a.apply_(x, g1, 0.01)
    a.apply_(x, g2, 0.01)
    b, y = fresh(), x.clone()
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as a checkpoint file holds it
    a.apply_(x, g3, 0.01)
    b.apply_(y, g3, 0.01)
    assert torch.equal(x, y)
