"""Choosing a correlated-noise mechanism: ``privacy.mechanism`` (and ``DPFedAvg(noise_stream=...)``) as a spec.

:class:`CorrelatedMechanism` names a mechanism and its parameters and builds its noise stream as the
mechanism's factory (``spec(seed, device=..., secure=...)``): :class:`~.tree.TreeNoise` (DP-FTRL, restarting every
``horizon`` releases), :class:`~.bandmf.BandMFNoise`, :class:`~.blt.BLTNoise`. Which accounting applies
(:mod:`.matrix_factorization`): BandMF under cyclic Poisson participation is amplified (the schedule's
per-cycle subsampled events, Choquette-Choo et al. 2023, arXiv:2306.08153, Thm. 4); everything else is one
Gaussian event per horizon, under min-separated or cyclic Poisson participation only. What has no sound
accounting is refused with one line: Poisson or fixed-size sampling (participations unbounded), BandMF with
more bands than the min separation, distributed or local placement (each client's share would have to be
correlated across the rounds it is not sampled in), adaptive clipping (its clip count is independent noise
and ``C`` moves, so the strategy's columns would not share one sensitivity), large-cohort emulation, and DiSK
(its Kalman filter models noise independent across rounds).

DP-FedAdamBC works: its Phi_t is the exact marginal variance of release ``t``'s noise (the stream's
``std_factor``). Its bias identity :math:`E[v_t] = E[x_t^2] + \\Phi_t` assumes noise independent of ``x_t``;
with correlated noise, ``x_t`` depends on earlier noise that release ``t``'s noise is correlated with, so a
cross term :math:`2E[x_t n_t]` remains (small when the model moves little per round; not corrected).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedprivacy.privacy.matrix_factorization import CorrelatedNoise

MechanismKind = Literal["tree", "bandmf", "blt"]


@dataclass(frozen=True)
class CorrelatedMechanism:
    """A correlated-noise mechanism, callable as a noise-stream factory (module docstring).

    Attributes:
        kind: ``tree``, ``bandmf`` or ``blt``.
        horizon: the releases one strategy covers (BandMF, BLT: optimized for it; all restart after it).
        groups: ``b``, the schedule's min separation (``privacy.groups``).
        bands: BandMF's bands (<= ``groups``).
        buffers: BLT's buffers.
        amplified: account as the cyclic Poisson schedule's own events (BandMF only).
    """

    kind: MechanismKind
    horizon: int
    groups: int = 1
    bands: int = 4
    buffers: int = 3
    amplified: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("tree", "bandmf", "blt"):
            raise ValueError(f"privacy.mechanism.kind must be tree, bandmf or blt, got {self.kind!r}")
        for name in ("horizon", "groups", "bands", "buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"privacy.mechanism.{name} must be an integer >= 1, got {value!r}")
        if self.amplified and self.kind != "bandmf":
            raise ValueError(f"amplified accounting is BandMF's (Choquette-Choo et al. 2023, Thm. 4), not {self.kind}'s")

    def __call__(self, seed: int, *, device: str | torch.device = "cpu", secure: bool = False) -> CorrelatedNoise:
        """The stream (``factory(seed, device=, secure=)``, as every noise stream)."""
        from fedprivacy.privacy.bandmf import BandMFNoise
        from fedprivacy.privacy.blt import BLTNoise
        from fedprivacy.privacy.tree import TreeNoise

        h, b = self.horizon, self.groups
        if self.kind == "tree":
            return TreeNoise(seed, device=device, secure=secure, horizon=h, separation=b)
        if self.kind == "bandmf":
            return BandMFNoise(seed, device=device, secure=secure, horizon=h, separation=b, bands=self.bands,
                               amplified=self.amplified)
        return BLTNoise(seed, device=device, secure=secure, horizon=h, separation=b, buffers=self.buffers)

    def describe(self) -> str:
        """How the settings and the release log name it."""
        extra = {"tree": "", "bandmf": f", bands={self.bands}, amplified={self.amplified}",
                 "blt": f", buffers={self.buffers}"}[self.kind]
        return f"{self.kind}(horizon={self.horizon}, groups={self.groups}{extra})"
