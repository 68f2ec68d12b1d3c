"""The Gaussian mechanism's noise source (ARCHITECTURE invariants 3 and 4).

One dense draw :math:`\\mathcal N(0, \\sigma^2 C^2 I_d)` per round over all ``d`` coordinates,
from a generator that nothing else draws from or reseeds. Its state is part of the checkpoint
so a resumed run draws exactly the noise an uninterrupted run would have drawn.

``secure=True`` seeds the generator from the OS's cryptographic source (``secrets``): the noise
is then not reproducible from the run seed, which is what a deployment wants. (PyTorch's
Mersenne Twister itself is not a CSPRNG; a fully cryptographic sampler is future work.)
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

NOISE_STREAM = 0x6E6F697365  # "noise": keeps this stream disjoint from other seeded stages


class GaussianNoise:
    """Dedicated generator for the server's Gaussian noise."""

    def __init__(self, seed: int, *, device: str | torch.device = "cpu", secure: bool = False,
                 stream: tuple[int, ...] = ()) -> None:
        """``stream`` names a separate generator of the same run (a client's share in round t:
        ``(t, partition)``), disjoint from the server's and from every other stream."""
        self.device = torch.device(device)
        self.secure = secure
        self._gen = torch.Generator(device=self.device)
        if secure:
            self._gen.manual_seed(secrets.randbits(63))
        else:
            entropy = [seed, NOISE_STREAM, *stream]
            self._gen.manual_seed(int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1))

    def add_(self, target: torch.Tensor, std: float) -> None:
        """Add ``N(0, std^2)`` to every coordinate of ``target`` in place (one dense draw)."""
        if std == 0.0:
            return
        noise = torch.empty_like(target).normal_(0.0, std, generator=self._gen)
        target.add_(noise)

    def state_dict(self) -> dict:
        return {"generator": self._gen.get_state(), "secure": self.secure}

    def load_state_dict(self, state: dict) -> None:
        self._gen.set_state(state["generator"])
        self.secure = bool(state["secure"])
