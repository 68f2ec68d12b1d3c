"""Server DP-MicroAdam's defining properties on plain tensors (arXiv:2511.20509)."""

import io
import math
import time

import pytest
import torch

from fedprivacy.optim.microadam import ServerMicroAdam, dequantize_4bit, quantize_4bit, ring_ages, top_k

STATE_TENSORS = ("ring_indices", "ring_values", "error_codes", "error_mins", "error_scales")


def _gaussians(d, steps, scale=1e-2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=gen) * scale * (1 + t) for t in range(steps)]


def _dequantized_error(opt):
    return dequantize_4bit(opt.error_codes, opt.error_mins, opt.error_scales, opt.dim, opt.bucket_size)


def _per_element_step(scales, bucket_size, numel):
    return scales.repeat_interleave(bucket_size)[:numel]


# -- reduction to Adam (T7) -------------------------------------------------------------------------


def _adam_ascent(x0, grads, lr, beta1, beta2, eps):
    """Textbook Adam in float64, ascending along g: x += lr * m_hat / (sqrt(v_hat) + eps)."""
    x, path = x0.double().clone(), []
    m = torch.zeros_like(x)
    v = torch.zeros_like(x)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        x = x + lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
        path.append(x.clone())
    return path


@pytest.mark.parametrize("ring_size", [7, 9])  # m == T and m > T
@pytest.mark.parametrize("per_tensor_sizes", [None, (100, 157)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_density_one_and_window_covering_all_steps_is_adam(ring_size, per_tensor_sizes, stochastic):
    # eps = 1e-3 is comparable to |g|: eps inside the sqrt, a missing bias correction or the
    # printed Algorithm 2 loop (which skips row 0) would all move the trajectory by >> atol.
    d, steps, lr, b1, b2, eps = 257, 7, 0.05, 0.9, 0.999, 1e-3
    grads = _gaussians(d, steps)
    x0 = torch.randn(d, generator=torch.Generator().manual_seed(1))
    opt = ServerMicroAdam(lr=lr, beta1=b1, beta2=b2, eps=eps, density=1.0, ring_size=ring_size, bucket_size=16,
                          stochastic_rounding=stochastic, per_tensor_sizes=per_tensor_sizes)
    x = x0.clone()
    for g, expected in zip(grads, _adam_ascent(x0, grads, lr, b1, b2, eps)):
        opt.step_(x, g)
        assert torch.equal(_dequantized_error(opt), torch.zeros(d))  # density 1: the residual is 0
        assert opt.last_update_indices.numel() == d
        torch.testing.assert_close(x.double(), expected, rtol=0, atol=1e-6)


# -- ring buffer (T6, T8, T9) ------------------------------------------------------------------------


def test_ring_ages_at_1_m_m_plus_1_and_2m_plus_3():
    m = 4
    assert ring_ages(1, m) == [0]  # the printed loop i in {1..min(t,m)} would skip row 0 here
    assert ring_ages(m, m) == [3, 2, 1, 0]
    assert ring_ages(m + 1, m) == [0, 3, 2, 1]  # row 0 overwritten: the step-1 entry is evicted
    assert ring_ages(2 * m + 3, m) == [2, 1, 0, 3]  # row (2m+2) mod m = 2 is the newest


def test_window_evicts_the_oldest_and_steps_match_the_closed_form():
    m, lr, b1, b2, eps = 4, 0.1, 0.9, 0.999, 1e-8
    last = 2 * m + 3
    d = last + 2
    opt = ServerMicroAdam(lr=lr, beta1=b1, beta2=b2, eps=eps, density=1e-9, ring_size=m, bucket_size=5)
    x = torch.zeros(d)
    signal = [(-1) ** t * (1.0 + 0.5 * t) for t in range(1, last + 1)]  # coordinate t-1 at step t
    for t in range(1, last + 1):
        g = torch.zeros(d)
        g[t - 1] = signal[t - 1]
        before = x.clone()
        opt.step_(x, g)
        window = list(range(max(0, t - m), t))  # coordinates of the last min(t, m) steps
        assert opt.last_update_indices.tolist() == window
        if t not in (1, m, m + 1, last):
            continue
        expected = torch.zeros(d, dtype=torch.float64)
        for coord in window:
            age, c = t - 1 - coord, signal[coord]
            m_hat = (1 - b1) * b1**age / (1 - b1**t) * c
            v_hat = (1 - b2) * b2**age / (1 - b2**t) * c * c
            expected[coord] = lr * m_hat / (eps + math.sqrt(v_hat))  # ascent along g
        torch.testing.assert_close((x - before).double(), expected, rtol=1e-5, atol=0)


def test_first_step_moves_the_k_selected_coordinates_by_lr_v_over_abs_v_plus_eps():
    d, lr, eps = 100, 0.5, 1e-2
    g = torch.linspace(-1, 1, d) * 0.02
    opt = ServerMicroAdam(lr=lr, eps=eps, density=0.1, bucket_size=33)
    x = torch.zeros(d)
    opt.step_(x, g)
    idx, val = top_k(g, 10)
    expected = torch.zeros(d)
    expected[idx] = lr * val / (val.abs() + eps)
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("per_tensor_sizes", [None, (7, 993, 1000)])
def test_update_support_is_at_most_min_t_m_times_k_and_is_what_the_downlink_sends(per_tensor_sizes):
    d, m = 2000, 3
    k_total = 20 if per_tensor_sizes is None else 1 + 10 + 10
    opt = ServerMicroAdam(lr=0.01, density=0.01, ring_size=m, bucket_size=128, per_tensor_sizes=per_tensor_sizes)
    x = torch.randn(d)
    for t, g in enumerate(_gaussians(d, 8), start=1):
        before = x.clone()
        opt.step_(x, g)
        support = opt.last_update_indices
        assert support.numel() <= min(t, m) * k_total
        assert support.numel() > (k_total if t > 1 else k_total - 1)  # old rows do contribute
        changed = (x != before).nonzero().squeeze(1)
        assert set(changed.tolist()) <= set(support.tolist())
        assert torch.equal(before.index_add_(0, support, opt.last_update_values), x)  # client replay is exact
        assert opt.downlink_bytes() == 8 * support.numel()
        assert opt.downlink_bytes(torch.int64) == 12 * support.numel()


def test_zero_input_gives_a_zero_step_and_no_nan():
    opt = ServerMicroAdam(density=0.1)
    x = torch.ones(50)
    for _ in range(3):
        opt.step_(x, torch.zeros(50))
    assert torch.equal(x, torch.ones(50))


# -- top-k (T1) ----------------------------------------------------------------------------------


def _heavy_tailed(d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=gen) / torch.rand(d, generator=gen).clamp_min(1e-3)


def _check_block(x, idx, val, k):
    assert idx.numel() == k
    assert torch.equal(val, x[idx])
    rest = torch.ones(x.numel(), dtype=torch.bool)
    rest[idx] = False
    if rest.any():
        assert val.abs().min() >= x[rest].abs().max()
    kept = torch.zeros_like(x)
    kept[idx] = val
    assert (x - kept).square().sum() <= (1 - k / x.numel()) * x.square().sum() * (1 + 1e-6)  # q-contraction


def test_global_top_k_keeps_the_k_largest_magnitudes_sorted_and_signed():
    x = _heavy_tailed(1000)
    idx, val = top_k(x, 37)
    assert idx.dtype == torch.int64 and bool((idx[1:] > idx[:-1]).all())
    _check_block(x, idx, val, 37)
    assert top_k(x, 5000)[0].numel() == 1000  # k is clamped to d


def test_per_tensor_top_k_splits_k_proportionally_with_at_least_one_per_tensor():
    sizes = (3, 500, 497)
    x = _heavy_tailed(sum(sizes), seed=1)
    idx, val = top_k(x, 50, per_tensor_sizes=sizes)
    assert bool((idx[1:] > idx[:-1]).all())
    offset = 0
    for n, k_b in zip(sizes, (1, 25, 25)):  # ceil(50 * n / 1000)
        inside = (idx >= offset) & (idx < offset + n)
        _check_block(x[offset : offset + n], idx[inside] - offset, val[inside], k_b)
        offset += n
    with pytest.raises(ValueError):
        top_k(x, 50, per_tensor_sizes=(3, 500))


# -- quantiser (T2, T3) ----------------------------------------------------------------------------


@pytest.mark.parametrize("bucket_size", [64, 1001, 5000])  # partial last bucket; one range (the paper's)
def test_deterministic_quantiser_error_is_at_most_half_a_step(bucket_size):
    x = _heavy_tailed(1001, seed=2)  # odd length: the last code byte is half used
    codes, mins, scales = quantize_4bit(x, bucket_size, stochastic=False)
    assert codes.dtype == torch.uint8 and codes.numel() == 501 and mins.numel() == math.ceil(1001 / bucket_size)
    x_hat = dequantize_4bit(codes, mins, scales, 1001, bucket_size)
    u = _per_element_step(scales, bucket_size, 1001)
    assert bool(((x_hat - x).abs() <= u / 2 + 1e-6 * x.abs().max()).all())
    assert x_hat[int(x.argmin())] == x.min()  # code 0 gives delta exactly
    assert bool(((x_hat - mins.repeat_interleave(bucket_size)[:1001]) / u).round().le(15).all())


def test_constant_bucket_has_zero_step_and_is_reconstructed_exactly():
    x = torch.cat((torch.full((8,), -2.5), torch.linspace(0, 1, 8), torch.zeros(3)))
    for stochastic in (False, True):
        codes, mins, scales = quantize_4bit(x, 8, stochastic, torch.Generator().manual_seed(0))
        assert scales[0] == 0 and scales[2] == 0
        x_hat = dequantize_4bit(codes, mins, scales, x.numel(), 8)
        assert torch.isfinite(x_hat).all()
        assert torch.equal(x_hat[:8], x[:8]) and torch.equal(x_hat[16:], x[16:])


def test_stochastic_quantiser_is_unbiased_and_reproducible():
    d, draws = 50, 20_000
    x = torch.linspace(-0.3, 1.1, d) + 0.01 * torch.sin(torch.arange(d, dtype=torch.float32))
    xs = x.repeat(draws)  # one bucket per copy: the same range, independent roundings
    codes, mins, scales = quantize_4bit(xs, d, True, torch.Generator().manual_seed(3))
    mean = dequantize_4bit(codes, mins, scales, xs.numel(), d).view(draws, d).double().mean(0)
    u = float(scales[0])
    # Per-element rounding variance is u^2 f(1-f) <= u^2/4, so the mean's std is <= u/(2 sqrt(draws)).
    assert float((mean - x.double()).abs().max()) <= 5 * u / (2 * math.sqrt(draws))
    deterministic = dequantize_4bit(*quantize_4bit(x, d, False), d, d)
    assert float((deterministic - x).abs().max()) > 5 * u / (2 * math.sqrt(draws))  # the check has power
    again = quantize_4bit(xs, d, True, torch.Generator().manual_seed(3))[0]
    assert torch.equal(codes, again)


# -- error feedback (T4) ---------------------------------------------------------------------------


@pytest.mark.parametrize("stochastic", [False, True])
def test_error_feedback_conserves_mass(stochastic):
    d, m, bucket = 300, 3, 32
    opt = ServerMicroAdam(lr=0.01, density=0.05, ring_size=m, bucket_size=bucket, stochastic_rounding=stochastic)
    x = torch.zeros(d)
    sent = torch.zeros(d, dtype=torch.float64)  # sum of the sparse s_tau
    fed = torch.zeros(d, dtype=torch.float64)  # sum of the gradients -g_tau
    slack = torch.zeros(d, dtype=torch.float64)  # sum of per-step quantisation bounds
    for t, g in enumerate(_gaussians(d, 6, seed=4), start=1):
        a = _dequantized_error(opt).sub_(g) if t > 1 else -g
        opt.step_(x, g)
        row = (t - 1) % m
        idx, val = opt.ring_indices[row].long(), opt.ring_values[row]
        assert torch.equal(val, a[idx])  # the selected part is a_t itself, signed
        residual = a.clone().index_fill_(0, idx, 0.0)
        assert torch.equal(residual.index_put((idx,), val), a)  # top-k part + residual == a_t exactly
        step = _per_element_step(opt.error_scales, bucket, d)
        bound = step if stochastic else step / 2
        assert bool(((_dequantized_error(opt) - residual).abs() <= bound + 1e-7).all())
        sent.index_add_(0, idx, val.double())
        fed -= g.double()
        slack += bound.double() + 1e-7
        # sum s + e_{t+1} = sum(-g) + sum of quantisation errors
        assert bool(((sent + _dequantized_error(opt).double() - fed).abs() <= slack).all())


# -- contract: inputs, checkpoints, scale -----------------------------------------------------------


def test_pseudo_gradient_is_not_mutated():
    opt = ServerMicroAdam(density=0.2, stochastic_rounding=True, bucket_size=10)
    x = torch.zeros(101)
    for g in _gaussians(101, 4):
        copy = g.clone()
        opt.step_(x, g)
        assert torch.equal(g, copy)


def _config(seed):
    return dict(lr=0.02, density=0.05, ring_size=4, bucket_size=64, stochastic_rounding=True, seed=seed)


def test_state_dict_round_trip_through_torch_save_is_bit_exact():
    d = 503
    grads = _gaussians(d, 6, seed=5)
    straight, x_straight = ServerMicroAdam(**_config(7)), torch.zeros(d)
    for g in grads:
        straight.step_(x_straight, g)

    first, x = ServerMicroAdam(**_config(7)), torch.zeros(d)
    for g in grads[:3]:
        first.step_(x, g)
    buffer = io.BytesIO()
    torch.save({"optimizer": first.state_dict(), "params": x}, buffer)
    snapshot = first.state_dict()
    first.step_(x.clone(), grads[3])  # later steps must not alter a taken snapshot
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = ServerMicroAdam(**_config(999))  # a different seed: the generator state must come from the file
    resumed.load_state_dict(checkpoint["optimizer"])
    x = checkpoint["params"]
    for g in grads[3:]:
        resumed.step_(x, g)

    assert torch.equal(x, x_straight)
    assert resumed.step == straight.step == 6
    for name in STATE_TENSORS:
        assert torch.equal(getattr(resumed, name), getattr(straight, name)), name
    assert torch.equal(resumed.generator.get_state(), straight.generator.get_state())
    for name in STATE_TENSORS:
        assert torch.equal(snapshot[name], checkpoint["optimizer"][name]), name


def test_invalid_configuration_and_inputs_are_refused():
    for bad in (dict(density=0.0), dict(density=1.5), dict(eps=0.0), dict(beta2=1.0), dict(ring_size=0)):
        with pytest.raises(ValueError):
            ServerMicroAdam(**bad)
    opt = ServerMicroAdam()
    opt.step_(torch.zeros(10), torch.ones(10))
    with pytest.raises(ValueError):
        opt.step_(torch.zeros(11), torch.ones(11))
    with pytest.raises(ValueError):
        ServerMicroAdam(ring_size=3).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError):
        ServerMicroAdam(per_tensor_sizes=(4, 5)).step_(torch.zeros(10), torch.ones(10))
    with pytest.raises(ValueError):
        quantize_4bit(torch.ones(4), 2, stochastic=True, generator=None)


@pytest.mark.parametrize("density", [0.01, 0.1])
def test_main_workload_dimension_steps(density):
    """d = 5,000,500 (the main workload). Timing is printed (``-s``), never asserted."""
    d, m = 5_000_500, 10
    opt = ServerMicroAdam(lr=1e-3, density=density, ring_size=m, bucket_size=100_000)
    x = torch.zeros(d)
    gen = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(2):
        g = torch.randn(d, generator=gen) * 1e-3
        start = time.perf_counter()
        opt.step_(x, g)
        seconds.append(time.perf_counter() - start)
    k = math.ceil(density * d)
    assert opt.last_update_indices.numel() <= 2 * k
    assert torch.isfinite(x).all() and int((x != 0).sum()) <= 2 * k
    print(f"\nServerMicroAdam d={d} density={density}: {seconds} s per step")
