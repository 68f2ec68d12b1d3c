r"""Server-side DP-MicroAdam on the privatized pseudo-gradient (Hudişteanu et al. 2025, arXiv:2511.20509,
Alg. 1 from line 8 on, with clients in place of examples: the paper has no federated setting).

The server treats :math:`-\tilde g_t` (the negated noised average of client deltas) as the gradient
and runs Algorithm 1 of DP-MicroAdam from line 8 on, in that gradient convention:

.. math::
    a_t &= -\tilde g_t + Q^{-1}(e_t) \\
    (\mathcal I_t, \mathcal V_t) &= T_k(a_t), \qquad s_t = \operatorname{scatter}(\mathcal I_t, \mathcal V_t) \\
    e_{t+1} &= Q(a_t - s_t) \\
    \hat m_t &= \frac{1-\beta_1}{1-\beta_1^t} \sum_{j=0}^{M_t-1} \beta_1^j s_{t-j}, \qquad
    \hat v_t = \frac{1-\beta_2}{1-\beta_2^t} \sum_{j=0}^{M_t-1} \beta_2^j s_{t-j}^2, \qquad M_t = \min(t, m) \\
    x_{t+1} &= x_t - \eta\, \frac{\hat m_t}{\epsilon_s + \sqrt{\hat v_t}}

Because top-k, :math:`\hat m` and :math:`\hat v` are odd/even in their input, this is the Adam-style
step :math:`x + \eta\,\hat m_t(\tilde g)/(\epsilon_s + \sqrt{\hat v_t(\tilde g)})` in the ASCENT
direction of :math:`\tilde g`, up to the quantiser's rounding (round-half-up ties and the stochastic
draws are not mirror-symmetric; in distribution the two are the same). All state (ring values, error
feedback) is kept in the gradient convention, exactly as the paper's Algorithm 1 would hold it.

Symbols: ``lr`` = η, ``beta1`` = β₁, ``beta2`` = β₂, ``eps`` = ε_s, ``ring_size`` = m (window),
``density`` = k/d with k = ⌈density·d⌉ (``k_total`` >= k after a per-tensor split),
``bucket_size`` = length of each (δ, Δ) quantisation range, t = ``self.step`` (from 1),
e = 4-bit error feedback, 𝒢 = (``ring_indices``, ``ring_values``), :math:`T_k` = top-k by magnitude.

The update is non-zero only on the union of the ring's supports (at most ``min(t, m)·k`` coordinates),
so the model change can be sent to clients sparsely: see :attr:`ServerMicroAdam.last_update_indices`
and :meth:`ServerMicroAdam.downlink_bytes`.

Privacy: POST stage. Every input is the released ``g_t`` of the Gaussian mechanism; the error
feedback, top-k support and moments are post-processing (paper §3) and never see raw client deltas.

References: Hudişteanu, Cyffers, Kalinin, "DP-MicroAdam: Private and Frugal Algorithm for Training and
Fine-tuning", arXiv:2511.20509, Algorithm 1 (lines 8-17), Algorithm 2 (AdamStats, Q, Q⁻¹),
Assumption 3 (randomized rounding); Modoranu et al. 2024, "MicroAdam", arXiv:2405.15593 (bucketed
4-bit error feedback).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fedprivacy.privacy.noise import torch_seed

LEVELS = 15  # 2^b - 1 with b = 4 bits (Algorithm 2, Q and Q^-1)
MICROADAM_STREAM = 0x6D6963726F  # "micro": keeps the rounding stream disjoint from other seeded stages
_STATE_TENSORS = ("ring_indices", "ring_values", "error_codes", "error_mins", "error_scales")


def _num_buckets(numel: int, bucket_size: int) -> int:
    return -(-numel // bucket_size)


def quantize_4bit(
    x: torch.Tensor, bucket_size: int, stochastic: bool, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Asymmetric min-max 4-bit quantisation of a flat vector, one (δ, Δ) range per bucket.

    .. math::
        u_b = \frac{\Delta_b - \delta_b}{2^4 - 1}, \qquad
        c_i = \operatorname{clamp}\Big(\Big\lfloor \frac{x_i - \delta_b}{u_b} + \xi_i \Big\rfloor, 0, 15\Big)

    with ``δ_b, Δ_b`` the min and max of bucket ``b`` (the ``bucket_size`` consecutive entries holding
    ``i``), ``ξ_i = 1/2`` (deterministic: round to nearest, Algorithm 2's Q; error ``<= u_b/2``) or
    ``ξ_i ~ U[0, 1)`` (stochastic: unbiased randomized rounding of Assumption 3). A constant bucket
    (``u_b = 0``) gets codes 0 and is reconstructed exactly; no NaN.

    Departure from the paper: Algorithm 1 keeps ONE (δ, Δ) pair for the whole vector; ranges per bucket
    follow MicroAdam's implementation. ``bucket_size >= x.numel()`` reproduces the paper.

    Args:
        x: 1-D floating tensor (not modified).
        bucket_size: entries per quantisation range; the last bucket may be shorter.
        stochastic: randomized rounding (True) or round-to-nearest (False).
        generator: the source of ξ; required when ``stochastic``.

    Returns:
        ``(codes, mins, scales)``: ``codes`` uint8 of length h = ⌈n/2⌉ with two 4-bit codes per byte
        (entry ``j < h`` in the low nibble of byte ``j``, entry ``h + j`` in its high nibble: contiguous
        halves, which pack and unpack without strided access), ``mins`` = δ_b and ``scales`` = u_b,
        each of length ⌈n/bucket_size⌉ and of ``x``'s dtype.

    Raises:
        ValueError: for an empty or non-1-D ``x``, ``bucket_size < 1``, or a missing generator.
    """
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError("quantize_4bit expects a non-empty 1-D tensor")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    if stochastic and generator is None:
        raise ValueError("stochastic rounding needs an explicit torch.Generator")
    n = x.numel()
    nb = _num_buckets(n, bucket_size)
    pad = nb * bucket_size - n
    # Padding repeats the last entry, so it never changes the last bucket's min or max.
    buckets = (x if pad == 0 else torch.cat((x, x[-1:].expand(pad)))).view(nb, bucket_size)
    mins, maxs = torch.aminmax(buckets, dim=1)
    scales = (maxs - mins) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = (buckets - mins[:, None]).div_(safe[:, None])
    if stochastic:  # Assumption 3's randomized rounding; Algorithm 2 as printed is the else branch
        y.add_(torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device))
    else:
        y.add_(0.5)
    # The clamp only catches float rounding just past 15 (Algorithm 2 assumes exact arithmetic); on
    # [0, 15] the cast to uint8 truncates, which is the floor of Algorithm 2.
    codes = y.clamp_(0, LEVELS).to(torch.uint8).view(-1)
    half = (n + 1) // 2
    high = codes[half:n] if 2 * half == n else torch.cat((codes[half:n], codes.new_zeros(1)))
    return (high << 4).bitwise_or_(codes[:half]), mins, scales


def dequantize_4bit(
    codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, numel: int, bucket_size: int
) -> torch.Tensor:
    r"""Inverse of :func:`quantize_4bit` (Algorithm 2's Q⁻¹ per bucket): :math:`\hat x_i = c_i u_b + \delta_b`.

    Args:
        codes: packed uint8 codes from :func:`quantize_4bit`.
        mins: δ_b per bucket.
        scales: u_b per bucket.
        numel: length n of the original vector.
        bucket_size: the bucket size used to quantise.

    Returns:
        A new 1-D tensor of length ``numel`` and the dtype of ``mins``.
    """
    nb, half = mins.numel(), codes.numel()
    full = codes.new_empty(max(nb * bucket_size, 2 * half))
    torch.bitwise_and(codes, 0x0F, out=full[:half])
    torch.bitwise_right_shift(codes, 4, out=full[half : 2 * half])
    full[2 * half :].zero_()
    values = full[: nb * bucket_size].view(nb, bucket_size).to(mins.dtype)
    return torch.addcmul(mins[:, None], values, scales[:, None]).view(-1)[:numel]


def _split_k(k: int, sizes: Sequence[int]) -> list[int]:
    """Per-block budgets ``min(n_b, ceil(k * n_b / d))`` in exact integer arithmetic (each >= 1)."""
    d = sum(sizes)
    return [min(n, -(-k * n // d)) for n in sizes]


def top_k(
    x: torch.Tensor, k: int, per_tensor_sizes: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The top-k operator :math:`T_k` on :math:`|x|` (Algorithm 1, line 9), global or per tensor.

    Global: the ``k`` entries of largest magnitude. Per tensor (``per_tensor_sizes`` = the lengths of
    the consecutive blocks of ``x``, summing to ``len(x)``): block ``b`` of length ``n_b`` keeps its
    ``k_b = min(n_b, ⌈k·n_b/d⌉)`` largest, so every block keeps at least one entry. With ``k = ⌈ρd⌉``
    and ``ρd`` an integer this is exactly the paper code's ``⌈ρ·n_b⌉`` per parameter tensor
    (github.com/MihaelaHudisteanu/DP-Micro-Adam; the paper, §2.3, says only "around 1%").
    Ties are broken by ``torch.topk``; the paper leaves them unspecified.

    Args:
        x: 1-D tensor (not modified).
        k: total budget, clamped to ``len(x)``; must be >= 1.
        per_tensor_sizes: block lengths, or ``None`` for one global selection.

    Returns:
        ``(indices, values)``: int64 indices in increasing order and the SIGNED ``x[indices]``.

    Raises:
        ValueError: if ``k < 1`` or the block lengths do not sum to ``len(x)``.
    """
    d = x.numel()
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    sizes = [d] if per_tensor_sizes is None else [int(n) for n in per_tensor_sizes]
    if sum(sizes) != d or min(sizes) < 1:
        raise ValueError(f"per_tensor_sizes {sizes} do not partition a vector of length {d}")
    indices = top_k_per_block(x, sizes, _split_k(min(k, d), sizes))
    return indices, x.index_select(0, indices)


def top_k_per_block(x: torch.Tensor, sizes: Sequence[int], budgets: Sequence[int]) -> torch.Tensor:
    """Positions, in increasing order, of the ``min(budgets[b], sizes[b])`` entries of largest ``|x|``
    within each consecutive block ``b`` of ``x`` (``sizes`` sum to ``len(x)``; empty blocks keep none).

    The one top-k of the package: :func:`top_k` (DP-MicroAdam's ``T_k``) and the client's uplink
    compression (:mod:`fedprivacy.client.compression`) differ only in their budgets. Ties are broken by
    ``torch.topk`` (a loop over blocks, not coordinates).
    """
    magnitude, picked, lo = x.abs(), [], 0
    for n, k_b in zip(sizes, budgets):
        if n > 0:
            picked.append(lo + torch.topk(magnitude.narrow(0, lo, n), min(k_b, n), sorted=False).indices)
        lo += n
    return torch.sort(torch.cat(picked)).values if picked else torch.zeros(0, dtype=torch.int64, device=x.device)


def ring_ages(step: int, ring_size: int) -> list[int]:
    r"""Age of each filled ring row at 1-based step ``t``: row ``j`` has age ``(t - 1 - j) mod m``.

    Rows are 0-based and row ``(t-1) mod m`` is written at step ``t`` (Algorithm 1, lines 10 and 17),
    so only rows ``0 .. min(t, m) - 1`` are filled.

    Departure from the paper: Algorithm 2 prints the loop ``i ∈ {1, …, min(t, m)}`` with age
    ``(t - i - 1) % m``; with 0-based rows that skips row 0 (the only filled row at ``t = 1``).
    The corrected loop is ``i ∈ {0, …, min(t, m) - 1}`` (the authors' code does this).

    Args:
        step: t >= 1.
        ring_size: m >= 1.

    Returns:
        ``[age of row 0, …, age of row min(t, m) - 1]``; the newest row has age 0.
    """
    return [(step - 1 - j) % ring_size for j in range(min(step, ring_size))]


class ServerMicroAdam:
    r"""DP-MicroAdam as the server optimizer: ``x <- x - lr * m̂/(eps + sqrt(v̂))`` on the gradient ``-g``.

    See the module docstring for the equations. State (all created on the first step, when ``d`` is
    known): the step count t, the ring buffer 𝒢 of the last m sparse gradients (int32 indices and
    float32 values, ``m x k_total``), the 4-bit error feedback e (packed codes plus per-bucket δ and
    u), and the stochastic-rounding generator. Only rows and buffers the optimizer owns are written in
    place; ``params`` is updated in place, ``pseudo_grad`` is only read.

    Args:
        lr: η (may be changed between steps, e.g. by a schedule).
        beta1, beta2: β₁, β₂ in [0, 1).
        eps: ε_s > 0, added OUTSIDE the square root (Algorithm 1, line 16; > 0 so that a selected
            zero, with m̂ = v̂ = 0, gives a zero step rather than NaN).
        density: k/d in (0, 1]; k = max(1, ⌈density·d⌉) (the paper code's ceil rule).
        ring_size: m >= 1, the window of sparse gradients.
        bucket_size: entries per quantisation range of the error feedback.
        stochastic_rounding: unbiased randomized rounding (Assumption 3) instead of round-to-nearest
            (Algorithm 2).
        per_tensor_sizes: lengths of the parameter tensors in flat order for per-tensor top-k
            (the paper code's choice); ``None`` for global top-k (Algorithm 1 as printed).
        seed: seeds the optimizer's own generator (only stochastic rounding draws from it).
        device: device of the generator and state; must match ``params``.

    Attributes:
        step: t, the number of steps taken (bias correction uses it, never a round number).
        last_update_indices: sorted int64 coordinates the last step wrote (the ring's union support;
            a written change can be 0, e.g. for a selected zero), or ``None`` before the first step.
        last_update_values: the float32 changes added at those coordinates.

    Raises:
        ValueError: for out-of-range hyperparameters.

    Privacy: POST stage; ``pseudo_grad`` must be the released output of the Gaussian mechanism.
    References: arXiv:2511.20509, Algorithm 1 and Algorithm 2.
    """

    def __init__(
        self,
        lr: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        density: float = 0.01,
        ring_size: int = 10,
        bucket_size: int = 100_000,
        stochastic_rounding: bool = False,
        per_tensor_sizes: Sequence[int] | None = None,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {beta1}, {beta2}")
        if not eps > 0.0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must lie in (0, 1], got {density}")
        if ring_size < 1 or bucket_size < 1:
            raise ValueError(f"ring_size and bucket_size must be >= 1, got {ring_size}, {bucket_size}")
        self.lr = lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.eps = eps
        self.density = density
        self.ring_size = ring_size
        self.bucket_size = bucket_size
        self.stochastic_rounding = stochastic_rounding
        self.per_tensor_sizes = None if per_tensor_sizes is None else tuple(int(n) for n in per_tensor_sizes)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(torch_seed(np.random.SeedSequence([seed, MICROADAM_STREAM])))
        self.step = 0
        self.dim: int | None = None
        self.ring_indices: torch.Tensor | None = None
        self.ring_values: torch.Tensor | None = None
        self.error_codes: torch.Tensor | None = None
        self.error_mins: torch.Tensor | None = None
        self.error_scales: torch.Tensor | None = None
        self.last_update_indices: torch.Tensor | None = None
        self.last_update_values: torch.Tensor | None = None

    def k_for(self, dim: int) -> int:
        """The top-k budget for a vector of length ``dim`` before any per-tensor split."""
        return min(dim, max(1, math.ceil(self.density * dim)))

    def _init_state(self, dim: int) -> None:
        if dim > torch.iinfo(torch.int32).max:
            raise ValueError(f"dimension {dim} does not fit the int32 ring indices")
        sizes = [dim] if self.per_tensor_sizes is None else list(self.per_tensor_sizes)
        if sum(sizes) != dim:
            raise ValueError(f"per_tensor_sizes sum to {sum(sizes)}, params have {dim} entries")
        k_total = sum(_split_k(self.k_for(dim), sizes))
        nb = _num_buckets(dim, self.bucket_size)
        self.dim = dim
        self.ring_indices = torch.zeros(self.ring_size, k_total, dtype=torch.int32, device=self.device)
        self.ring_values = torch.zeros(self.ring_size, k_total, dtype=torch.float32, device=self.device)
        # e_1 = 0 (Algorithm 1, lines 3-4): zero codes with δ = u = 0 dequantise to exactly 0.
        self.error_codes = torch.zeros(-(-dim // 2), dtype=torch.uint8, device=self.device)
        self.error_mins = torch.zeros(nb, dtype=torch.float32, device=self.device)
        self.error_scales = torch.zeros(nb, dtype=torch.float32, device=self.device)

    def step_(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        """One DP-MicroAdam step on flat float32 ``params`` (in place) from the released ``pseudo_grad``.

        Sets :attr:`last_update_indices` (sorted int64, the union support of the ring buffer) and
        :attr:`last_update_values` (the float32 change added there; ``params`` changes nowhere else).
        """
        if params.dim() != 1 or params.shape != pseudo_grad.shape or params.dtype != torch.float32:
            raise ValueError("params and pseudo_grad must be flat float32 tensors of the same length")
        if self.dim is None:
            self._init_state(params.numel())
        if params.numel() != self.dim:
            raise ValueError(f"optimizer state is for dimension {self.dim}, got {params.numel()}")
        self.step += 1
        t = self.step
        # Line 8, with the gradient -pseudo_grad (the server ascends along the noised mean delta).
        a = dequantize_4bit(self.error_codes, self.error_mins, self.error_scales, self.dim, self.bucket_size)
        a = a.sub_(pseudo_grad)
        idx, val = top_k(a, self.k_for(self.dim), self.per_tensor_sizes)  # line 9
        row = (t - 1) % self.ring_size  # lines 10 and 17 with i = 0 before the first step
        self.ring_indices[row].copy_(idx)
        self.ring_values[row].copy_(val)
        a.index_fill_(0, idx, 0.0)  # line 11: the residual, so every bucket range is taken after zeroing
        self.error_codes, self.error_mins, self.error_scales = quantize_4bit(  # lines 12-13
            a, self.bucket_size, self.stochastic_rounding, self.generator
        )
        indices, change = self._moments_step(t)  # lines 14-16
        params.index_add_(0, indices, change)
        self.last_update_indices, self.last_update_values = indices, change

    def _moments_step(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """AdamStats over the filled rows (Algorithm 2, loop corrected) and the step on their union."""
        ages = ring_ages(t, self.ring_size)
        filled = len(ages)
        # Bias correction uses the GLOBAL t and the window weights are not renormalised (Algorithm 2, as printed).
        c1 = (1.0 - self.beta1) / (1.0 - self.beta1**t)
        c2 = (1.0 - self.beta2) / (1.0 - self.beta2**t)
        w1 = torch.tensor([c1 * self.beta1**r for r in ages], dtype=torch.float32, device=self.device)
        w2 = torch.tensor([c2 * self.beta2**r for r in ages], dtype=torch.float32, device=self.device)
        flat_idx = self.ring_indices[:filled].reshape(-1).long()
        values = self.ring_values[:filled]
        # Scatter-ADD: one coordinate may sit in several rows (Algorithm 2's z[I_i] <- z[I_i] + beta^r V_i).
        zeros = dict(dtype=torch.float32, device=self.device)
        m_hat = torch.zeros(self.dim, **zeros).scatter_add_(0, flat_idx, (values * w1[:, None]).view(-1))
        v_hat = torch.zeros(self.dim, **zeros).scatter_add_(0, flat_idx, (values.square() * w2[:, None]).view(-1))
        support = torch.zeros(self.dim, dtype=torch.bool, device=self.device).index_fill_(0, flat_idx, True)
        indices = support.nonzero().squeeze(1)
        denom = v_hat.index_select(0, indices).sqrt_().add_(self.eps)  # eps OUTSIDE the sqrt (line 16)
        return indices, m_hat.index_select(0, indices).div_(denom).mul_(-self.lr)

    def downlink_bytes(self, index_dtype: torch.dtype = torch.int32) -> int:
        """Bytes to send the last step's model change as COO pairs.

        Encoding: the sorted coordinates of :attr:`last_update_indices` as ``index_dtype`` (int32 by
        default: 4 bytes, enough for any d < 2^31; int64 matches the client uplink's 8) followed by the
        float32 :attr:`last_update_values` (4 bytes each), which a client adds to its copy of the model
        to reproduce the server's ``params`` bit for bit. Dense float32 would cost ``4·d`` bytes.
        Returns 0 before the first step.
        """
        if self.last_update_indices is None:
            return 0
        if self.dim > torch.iinfo(index_dtype).max:
            raise ValueError(f"{index_dtype} cannot hold indices below {self.dim}")
        per_entry = torch.empty((), dtype=index_dtype).element_size() + 4
        return self.last_update_indices.numel() * per_entry

    def state_dict(self) -> dict:
        """A snapshot (cloned tensors) of everything a resumed run needs to continue bit for bit."""
        state = {name: None if getattr(self, name) is None else getattr(self, name).clone() for name in _STATE_TENSORS}
        return {"step": self.step, "dim": self.dim, "generator": self.generator.get_state(), **state}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` snapshot (copied, so later steps never alter ``state``)."""
        ring = state["ring_indices"]
        if ring is not None and ring.shape[0] != self.ring_size:
            raise ValueError(f"checkpoint ring has {ring.shape[0]} rows, optimizer ring_size is {self.ring_size}")
        self.step = int(state["step"])
        self.dim = None if state["dim"] is None else int(state["dim"])
        self.generator.set_state(state["generator"])
        for name in _STATE_TENSORS:
            setattr(self, name, None if state[name] is None else state[name].to(self.device, copy=True))
        self.last_update_indices = self.last_update_values = None
