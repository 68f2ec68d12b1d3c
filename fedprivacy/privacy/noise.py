"""The Gaussian mechanism's noise source (ARCHITECTURE invariants 3 and 4).

One dense draw :math:`\\mathcal N(0, \\sigma^2 C^2 I_d)` per round over all ``d`` coordinates,
from a generator that nothing else draws from or reseeds. Its state is part of the checkpoint
so a resumed run draws exactly the noise an uninterrupted run would have drawn.

``secure=True`` seeds the generator from the OS's cryptographic source (``secrets``): the noise
is then not reproducible from the run seed, which is what a deployment wants. (PyTorch's
Mersenne Twister itself is not a CSPRNG; a fully cryptographic sampler is future work.)

A round's draw can be started early (:meth:`GaussianNoise.prefetch_`) on a background thread while
the clients train: the same generator, the same single draw, consumed by the next :meth:`add_`,
so the released values and the generator state are bit-identical to drawing it at release time.
"""

from __future__ import annotations

import secrets
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

NOISE_STREAM = 0x6E6F697365  # "noise": keeps this stream disjoint from other seeded stages


def torch_seed(seq: np.random.SeedSequence) -> int:
    """A seed for ``torch.Generator.manual_seed`` from ``seq``: its first 64-bit word, shifted to 63 bits."""
    return int(seq.generate_state(1, np.uint64)[0] >> 1)


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
            self._gen.manual_seed(torch_seed(np.random.SeedSequence([seed, NOISE_STREAM, *stream])))
        self._pending: tuple[Future, float, torch.Size, torch.dtype] | None = None
        self._worker: ThreadPoolExecutor | None = None

    def _draw(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.empty_like(like).normal_(0.0, std, generator=self._gen)

    def prefetch_(self, like: torch.Tensor, std: float) -> None:
        """Start the next :meth:`add_`'s draw (``like``'s shape, dtype and device; std ``std``) on a
        background thread. Only for a draw that WILL be made next with exactly these arguments:
        the generator advances now, so :meth:`add_` refuses anything else rather than shift the stream."""
        if self._pending is not None:
            raise RuntimeError("a noise draw is already prefetched and not yet consumed")
        if std == 0.0:
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noise")
        self._pending = (self._worker.submit(self._draw, like, std), std, like.shape, like.dtype)

    def add_(self, target: torch.Tensor, std: float) -> None:
        """Add ``N(0, std^2)`` to every coordinate of ``target`` in place (one dense draw)."""
        if self._pending is not None:
            future, pending_std, shape, dtype = self._pending
            noise = future.result()
            self._pending = None
            if (pending_std, shape, dtype) != (std, target.shape, target.dtype):
                raise RuntimeError(f"prefetched noise (std {pending_std}, shape {tuple(shape)}) does not match this "
                                   f"draw (std {std}, shape {tuple(target.shape)})")
            target.add_(noise)
            return
        if std == 0.0:
            return
        target.add_(self._draw(target, std))

    def state_dict(self) -> dict:
        if self._pending is not None:
            raise RuntimeError("cannot checkpoint the noise generator while a prefetched draw is unconsumed")
        return {"generator": self._gen.get_state(), "secure": self.secure}

    def load_state_dict(self, state: dict) -> None:
        if self._pending is not None:
            raise RuntimeError("cannot restore the noise generator while a prefetched draw is unconsumed")
        self._gen.set_state(state["generator"])
        self.secure = bool(state["secure"])
