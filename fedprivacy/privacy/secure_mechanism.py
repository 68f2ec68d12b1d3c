r"""The distributed Skellam mechanism under secure aggregation, as a :class:`~fedprivacy.privacy.mechanism.GaussianMechanism`
seam: the clients clip and add their integer Skellam shares (:mod:`.skellam`), the server sums the masked uploads
modulo :math:`2^b`, removes the masks (:mod:`fedprivacy.fl.secure_aggregation`) and decodes; it adds NO noise and
cannot top up a dropped client's share (noise the server draws protects nobody from the server).

.. math:: g_t = \frac{1}{m}\,\mathrm{decode}\Big(\sum_{i \in S'_t} v_i \bmod 2^b\Big), \qquad
          \text{event}_t = \text{Skellam}(q = m/N, \ \mu = |S'_t|\,\mu/m, \ \Delta_1, \Delta_2)

with :math:`S'_t` the clients whose masked share reached the server (survivors): the event is logged ahead, once the
survivors are known and before the unmasking reveals their sum, with the noise they actually added
(:meth:`SkellamMechanism.release_event`). ``m`` stays the divisor (invariant 2). A sum larger than its survivors'
honest uploads could make it is refused after that log (:meth:`SecureSum.release`): the release stays accounted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedprivacy.privacy.accounting import AccountantKind, would_exceed
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.events import AccountedEvent
from fedprivacy.privacy.mechanism import GaussianMechanism, Release
from fedprivacy.privacy.noise import GaussianNoise, NoiseStream
from fedprivacy.privacy.skellam import SkellamParams
from fedprivacy.privacy.skellam_accounting import SkellamRound


class SecureSum(PrivateSum):
    """The round's sum of masked uploads modulo ``2^bits`` (uint64 accumulator) and who contributed."""

    def __init__(self, params: SkellamParams, *, noise_multiplier: float, expected_cohort: float,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(0, clip_norm=params.clip_norm, noise_multiplier=noise_multiplier,
                         expected_cohort=expected_cohort, device=device, placement="distributed")
        self.params = params
        self.masked_sum = np.zeros(params.padded_dim, dtype=np.uint64)
        self.survivors: list[int] = []
        self.unmask: Callable[[], np.ndarray] | None = None
        """Set by the protocol once the survivors are known: the sum of their masks (mod 2^bits)."""
        self.rotation_seed = 0

    def add_masked(self, node: int, values: np.ndarray) -> None:
        """Add one client's masked upload (uint32 of length D, already checked)."""
        self.masked_sum += values
        self.survivors.append(node)
        self.stats.received += 1
        self.stats.accepted += 1

    def server_noise_std(self) -> float:
        return 0.0

    def prefetch_noise(self, noise: NoiseStream) -> None:
        """Nothing to draw: the noise is the clients'."""

    def release(self, noise: NoiseStream) -> torch.Tensor:
        """Unmask, check the sum's norm against what its survivors could have made it (else
        :class:`~fedprivacy.privacy.skellam.IntegrityCheckFailed`: nothing is released), decode and divide by ``m``:
        the only value that leaves the mechanism."""
        assert self.unmask is not None, "the protocol sets unmask before the release"
        modulus = np.uint64(self.params.modulus - 1)
        clear = (self.masked_sum - self.unmask().astype(np.uint64)) & modulus
        self.params.check_integrity(clear, len(self.survivors))
        return self.params.decode(clear, self.rotation_seed).to(self._sum.device).div_(self.expected_cohort)


class SkellamMechanism(GaussianMechanism):
    """:class:`GaussianMechanism` with the clients' Skellam shares summed under secure aggregation (module docstring).

    Args:
        bits: the modulus bit width b.
        min_shares: the fewest shares a release can have (SecAgg+'s threshold): what the budget check assumes.
        **kwargs: :class:`GaussianMechanism`'s; needs ``placement="distributed"``, Poisson sampling, independent
            noise, a fixed clip and no large-cohort emulation.
    """

    def __init__(self, *, bits: int, min_shares: int = 1, **kwargs: Any) -> None:
        wrong = {k: kwargs.get(k) for k, ok in (("placement", "distributed"), ("sampling", "poisson"))
                 if kwargs.get(k, "poisson") != ok}
        if wrong or kwargs.get("adaptive") or kwargs.get("noise_cohort") or kwargs.get(
                "noise_stream", GaussianNoise) is not GaussianNoise:
            raise ValueError(f"secure aggregation with Skellam noise needs placement='distributed', sampling='poisson', "
                             f"a fixed clip norm, independent noise and no noise_cohort (got {wrong or kwargs})")
        self.bits, self.min_shares = bits, min_shares
        self.dim: int | None = None
        """The model's size d, set when the strategy adopts a model (the mechanism's scale depends on it)."""
        super().__init__(**kwargs)

    def params(self) -> SkellamParams:
        if self.dim is None:
            raise ValueError("the Skellam mechanism needs the model's size: adopt a model first")
        return SkellamParams(dim=self.dim, clip_norm=self.clip_norm, noise_multiplier=self.noise_multiplier,
                             expected_cohort=self.expected_cohort, bits=self.bits)

    def event_at(self, release: int) -> AccountedEvent:
        """The PLANNED event: all ``m`` shares (what budget checks and calibration use); before a model is adopted,
        the Gaussian event of the same ``z`` (only the constructor's range check sees it)."""
        if self.dim is None:
            return super().event_at(release)
        return self.params().event(self.expected_cohort, self.expected_cohort / self.population)

    def budget_accountable(self, kind: AccountantKind) -> tuple[bool, str]:
        """RDP only: its rounds state their own RDP curve (planned once ``d`` is known)."""
        return kind == "rdp", "secure_aggregation's Skellam rounds"

    def would_exceed(self, delta: float, kind: AccountantKind, target: float) -> bool:
        """Whether the next release could take epsilon above ``target``: with as few as ``min_shares`` survivors
        (invariant 8 whatever drops out)."""
        worst = self.params().event(self.min_shares, self.expected_cohort / self.population)
        return would_exceed(self.ledger, worst, delta, kind, target)

    def release_event(self, agg: PrivateSum) -> AccountedEvent:
        """The noise the survivors actually added: ``len(survivors)`` shares."""
        assert isinstance(agg, SecureSum)
        return agg.params.event(len(agg.survivors), self.expected_cohort / self.population)

    def could_log(self, release: int, event: AccountedEvent) -> bool:
        """A Skellam round of this mechanism with any number ``1..population`` of surviving shares."""
        if not isinstance(event, SkellamRound) or self.dim is None:
            return False
        planned = self.params().event(1, self.expected_cohort / self.population)
        shares = event.variance / planned.variance if planned.variance > 0 else 1.0
        return (round(shares) >= 1 and round(shares) <= self.population and abs(shares - round(shares)) < 1e-9
                and (event.q, event.l2_sensitivity, event.l1_sensitivity)
                == (planned.q, planned.l2_sensitivity, planned.l1_sensitivity))

    def aggregator(self, dim: int) -> SecureSum:
        self.dim = dim
        return SecureSum(self.params(), noise_multiplier=self.noise_multiplier,
                         expected_cohort=float(self.expected_cohort), device=self.device)

    def release(self, agg: PrivateSum, round_: int) -> Release:
        """:meth:`GaussianMechanism.release`; if the unmasking fails or the sum is refused after the release was
        logged ahead, the release stays accounted (the server held the masked uploads: over-count, never
        under-count)."""
        try:
            return super().release(agg, round_)
        except Exception:
            self.ledger.compose(self.release_event(agg))
            raise

