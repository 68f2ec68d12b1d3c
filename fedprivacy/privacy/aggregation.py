"""The privatized aggregate of one round: clip -> unweighted sum -> ONE Gaussian draw -> fixed divisor.

.. math::
    g_t = \\frac{1}{m} \\Big( \\sum_{i \\in S_t} \\operatorname{clip}(u_i, C)
          + \\mathcal N(0, z^2 C^2 I_d) \\Big)

with ``m`` the EXPECTED cohort from the config, never the number of replies (invariant 2), so
the released value's sensitivity is ``C/m`` and its noise std ``zC/m`` whatever the realised
cohort. Updates are streamed: memory is one accumulator of size ``d``, not one per client.

Updates arrive as :class:`~fedprivacy.updates.SparseUpdate` (a flat COO vector: the coordinates not listed are zero)
or dense. Clipping the listed values IS clipping the whole vector, because the indices must be
strictly increasing and in range: a repeated index would let a client add more than its clipped
norm, so such an update is rejected.

Exact sensitivity: the clip uses a rigorous upper bound on each update's exact L2 norm
(:func:`~fedprivacy.privacy.clipping.l2_norm_bound`: chunked float32 norms summed in float64 and
inflated by their worst-case rounding), so no reply can hide mass from it the way it can from a
float32 sum (tiny entries whose squares vanish beside a few large ones: 1.018 C measured). The clip
targets ``C (1 - 2^-20)``, which absorbs the float32 rounding of the scale and of each scaled value:
the contribution actually added has L2 norm ``<= C`` computed exactly. Values must be float32 and
indices int64 (what :mod:`fedprivacy.fl.records` decodes after checking the payload's real dtype,
byte order and shape against the contract).

Rejections (invariants 11 and 12): a reply that is missing, failed, malformed, of the wrong dtype,
holds NaN/Inf, or (sample-level DP clients) carries no valid accounting event contributes zero,
counted by reason (:data:`~fedprivacy.updates.REJECTION_REASONS`). Nothing about a rejection changes the noise or the
divisor (under the distributed placement a rejected upload's noise share is topped up by the server).

Privacy: MECHANISM stage. Everything downstream (server optimizer, filters) sees only ``g_t``.
References: McMahan et al. 2018, arXiv:1710.06963v3, Alg. 1 (DP-FedAvg with fixed denominator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedprivacy.privacy.clipping import clip_scale, float32_exact_scale, l2_norm_bound
from fedprivacy.privacy.noise import NoiseStream
from fedprivacy.privacy.placement import Placement, server_noise_std
from fedprivacy.updates import REJECTION_REASONS, SparseUpdate


@dataclass
class AggregationStats:
    """Diagnostics of one round (raw norms are NOT private; they are for the simulation's user)."""

    received: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTION_REASONS, 0))
    first_rejection: dict[str, str] = field(default_factory=dict)
    """reason -> the first rejected reply's source and detail (for one warning per reason)."""
    clipped: int = 0
    norms: list[float] = field(default_factory=list)
    raw_updates: bool = True
    """Whether the server sees each update before any noise (central placement): only then are ``clipped`` and
    ``norms`` kept and ``clipped_fraction``, ``update_norm_median`` and ``clipped_mean_norm`` reported (noise-free,
    NOT private)."""
    clipped_mean_norm: float | None = None
    r""":math:`\lVert \sum_i \operatorname{clip}(u_i, C) \rVert / m` before the noise (the signal the noise,
    of norm about :math:`z C \sqrt d / m`, is added to); set at the release."""

    def as_metrics(self) -> dict[str, float]:
        norms = torch.tensor(self.norms) if self.norms else torch.zeros(1)
        return {
            "cohort_received": float(self.received),
            "cohort_accepted": float(self.accepted),
            **{f"rejected_{reason}": float(n) for reason, n in self.rejected.items()},
            **({"clipped_fraction": self.clipped / self.accepted if self.accepted else 0.0,
                "update_norm_median": float(norms.median())} if self.raw_updates else {}),
            **({"clipped_mean_norm": self.clipped_mean_norm}
               if self.raw_updates and self.clipped_mean_norm is not None else {}),
        }

    def rejection_warnings(self) -> list[str]:
        """One line per reason that rejected a reply: the count and the first example."""
        return [f"{n} update(s) rejected as zero ({reason}), first: {self.first_rejection[reason]}"
                for reason, n in self.rejected.items() if n]


class PrivateSum:
    """Accumulates clipped client updates for one round, then releases the noised average."""

    def __init__(self, dim: int, *, clip_norm: float, noise_multiplier: float, expected_cohort: float,
                 device: str | torch.device = "cpu", placement: Placement = "central") -> None:
        """``placement`` other than central: uploads arrive clipped and noised by their clients, so they
        are summed as they are and the server draws only the missing noise (:mod:`.placement`)."""
        if expected_cohort <= 0:
            raise ValueError(f"expected_cohort must be > 0, got {expected_cohort}")
        self.placement = placement
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.expected_cohort = expected_cohort
        self._sum = torch.zeros(dim, dtype=torch.float32, device=device)
        self.stats = AggregationStats(raw_updates=placement == "central")

    def reject(self, reason: str, source: object = "?", detail: str = "") -> None:
        """Count a reply that contributes zero (one of :data:`~fedprivacy.updates.REJECTION_REASONS`)."""
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        self.stats.received += 1
        self.stats.rejected[reason] += 1
        self.stats.first_rejection.setdefault(reason, f"{source}: {detail}" if detail else str(source))

    def add_(self, update: SparseUpdate, source: object = "?") -> bool:
        """Clip ``update`` and add it (its tensors are never written); return whether it was accepted.

        Rejected (counted by reason, contributes zero): malformed, values not float32, NaN/Inf.
        ``source`` names the reply in the rejection warning.
        """
        if not update.is_well_formed(self._sum.numel()):
            self.reject("malformed", source, "not a well-formed update of this dimension")
            return False
        if update.values.dtype != self._sum.dtype:
            self.reject("dtype", source, f"values are {update.values.dtype}, expected {self._sum.dtype}")
            return False
        norm = l2_norm_bound(update.values)
        if not math.isfinite(norm):  # a float64 norm of finite float32 values is finite: NaN/Inf present
            self.reject("nonfinite", source, "NaN or Inf values")
            return False
        self.stats.received += 1
        # central: clip(u) = scale * u, folded into the accumulation below; otherwise the upload
        # is already clipped and noised on the client (its norm is mostly noise: no diagnostic kept)
        scale = clip_scale(norm, self.clip_norm) if self.placement == "central" else 1.0
        if self.stats.raw_updates:
            self.stats.norms.append(norm)
            self.stats.clipped += norm > self.clip_norm
        self.stats.accepted += 1
        values, scale = float32_exact_scale(update.values.to(self._sum.device), scale)
        if update.indices is None:
            self._sum.add_(values, alpha=scale)
        elif update.block == 1:
            self._sum.index_add_(0, update.indices.to(self._sum.device), values, alpha=scale)
        else:  # whole rows: O(r) row additions
            self._sum.view(-1, update.block).index_add_(0, update.indices.to(self._sum.device), values, alpha=scale)
        return True

    def server_noise_std(self) -> float:
        """Std of the server's draw for this round (zC when central; see :func:`.placement.server_noise_std`)."""
        return server_noise_std(self.placement, self.noise_multiplier, self.clip_norm, self.expected_cohort,
                                self.stats.accepted)

    def prefetch_noise(self, noise: NoiseStream) -> None:
        """Start the release's draw now, on ``noise``'s background thread, when it cannot depend on
        the replies (central placement: std ``zC``, nonzero); :meth:`release` then consumes it. The
        same draw from the same generator state as drawing at release: the values are bit-identical.
        The next round's release of the same mechanism has the same shape: calling this after
        :meth:`release` starts that round's draw (whatever its ``C``)."""
        if self.placement == "central" and self.server_noise_std() > 0:
            noise.prefetch_(self._sum)

    def release(self, noise: NoiseStream) -> torch.Tensor:
        """``(sum + N(0, s^2 I)) / m`` with ``s = server_noise_std()``: the only value that leaves the mechanism.
        Central placement also notes the noise-free mean's norm (:attr:`AggregationStats.clipped_mean_norm`)."""
        if self.stats.raw_updates:
            self.stats.clipped_mean_norm = float(torch.linalg.vector_norm(self._sum)) / self.expected_cohort
        noise.add_(self._sum, self.server_noise_std())
        return self._sum.div_(self.expected_cohort)
