"""The record-level Gaussian mechanism under Opacus: per-unit clip, preconditioning, micro-batches, noise source."""

import pytest
import torch

from fedprivacy.optim.sample_dp import clip_factors
from sdp_helpers import closure_for, dp_setup, manual_per_sample_grads, tiny_batch, tiny_model

C = 0.5


def _noiseless_sum(opt, gsm, x, y):
    """Run one clip/accumulate pass; return the flat ``sum_j clip(u_j)`` Opacus' pipeline built."""
    opt.zero_grad(set_to_none=True)
    closure_for(gsm, x, y)()
    opt.clip_and_accumulate()
    return torch.cat([p.summed_grad.reshape(-1) for p in opt.params])


def _manual_clipped_sum(units, clip_norm):
    norms = units.norm(dim=1)
    return (units * torch.clamp(clip_norm / norms, max=1.0)[:, None]).sum(0), norms


def test_clip_factors_exact_and_zero_safe():
    norms = torch.tensor([0.0, 0.25, 0.5, 2.0], dtype=torch.float64)
    assert clip_factors(norms, 0.5).tolist() == [1.0, 1.0, 1.0, 0.25]


@pytest.mark.parametrize("k", [1, 4])
def test_per_unit_clip_matches_manual_and_bounds_each_unit(k):
    model = tiny_model()
    x, y = tiny_batch(8)
    units = manual_per_sample_grads(model, x, y).view(8 // k, k, -1).mean(1)
    clip_norm = float(units.norm(dim=1).mean())  # some units are clipped, some are not
    expected, norms = _manual_clipped_sum(units, clip_norm)
    assert (norms > clip_norm).any() and (norms < clip_norm).any()
    gsm, opt = dp_setup(model, lambda p: torch.optim.SGD(p, lr=0.1), noise_multiplier=0.0,
                        max_grad_norm=clip_norm, expected_batch_size=8 // k, micro_batch_size=k)
    torch.testing.assert_close(_noiseless_sum(opt, gsm, x, y), expected, rtol=1e-12, atol=1e-12)
    got_units = torch.cat([u.flatten(1) for u in opt.unit_gradients()], dim=1)
    torch.testing.assert_close(got_units, units, rtol=1e-12, atol=1e-12)
    clipped_norms = got_units.norm(dim=1) * clip_factors(got_units.norm(dim=1), clip_norm)
    assert bool((clipped_norms <= clip_norm * (1 + 1e-12)).all())


def test_preconditioning_happens_before_the_clip():
    model = tiny_model()
    x, y = tiny_batch(8)
    reference = manual_per_sample_grads(model, x, y)
    gen = torch.Generator().manual_seed(5)
    a = [torch.rand(p.shape, generator=gen, dtype=torch.float64) + 0.1 for p in model.parameters()]
    flat_a = torch.cat([t.reshape(-1) for t in a])
    expected, _ = _manual_clipped_sum(reference / flat_a, C)
    gsm, opt = dp_setup(model, lambda p: torch.optim.SGD(p, lr=0.1), noise_multiplier=0.0, max_grad_norm=C,
                        expected_batch_size=8, preconditioner=a)
    torch.testing.assert_close(_noiseless_sum(opt, gsm, x, y), expected, rtol=1e-12, atol=1e-12)


def test_micro_batches_must_be_whole():
    model = tiny_model()
    x, y = tiny_batch(6)
    gsm, opt = dp_setup(model, lambda p: torch.optim.SGD(p, lr=0.1), noise_multiplier=0.0, max_grad_norm=C,
                        expected_batch_size=2, micro_batch_size=4)
    with pytest.raises(ValueError, match="micro-batches"):
        _noiseless_sum(opt, gsm, x, y)


def test_noise_comes_only_from_the_dedicated_generator():
    sigma, b = 2.0, 8
    model = tiny_model()
    x, y = tiny_batch(b)
    clipped, _ = _manual_clipped_sum(manual_per_sample_grads(model, x, y), C)
    gsm, opt = dp_setup(model, lambda p: torch.optim.SGD(p, lr=0.0), noise_multiplier=sigma, max_grad_norm=C,
                        expected_batch_size=b, generator=torch.Generator().manual_seed(77))
    global_state = torch.random.get_rng_state()
    opt.zero_grad(set_to_none=True)
    opt.step(closure_for(gsm, x, y))
    assert torch.equal(torch.random.get_rng_state(), global_state)
    replay = torch.Generator().manual_seed(77)  # Opacus draws one tensor per parameter, in order
    noise = torch.cat([torch.normal(0.0, sigma * C, p.shape, generator=replay, dtype=p.dtype).reshape(-1)
                       for p in opt.params])
    grad = torch.cat([p.grad.reshape(-1) for p in opt.params])
    torch.testing.assert_close(grad, (clipped + noise) / b, rtol=1e-12, atol=1e-12)


def test_empty_batch_is_a_noise_only_step_and_is_accounted():
    from opacus.accountants import RDPAccountant

    model = tiny_model()
    gsm, opt = dp_setup(model, lambda p: torch.optim.SGD(p, lr=1.0), noise_multiplier=1.0, max_grad_norm=C,
                        expected_batch_size=4)
    acct = RDPAccountant()
    opt.attach_step_hook(acct.get_optimizer_hook_fn(sample_rate=0.1))
    for p in gsm.parameters():
        p.grad_sample = p.new_zeros((0, *p.shape))
    before = torch.cat([p.detach().reshape(-1).clone() for p in opt.params])
    opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in opt.params])
    assert torch.isfinite(after).all() and not torch.equal(before, after)
    assert acct.history == [(1.0, 0.1, 1)]
