r"""The Gaussian mechanism's noise source (ARCHITECTURE invariants 3 and 4).

One dense draw :math:`\mathcal N(0, \sigma^2 C^2 I_d)` per round over all ``d`` coordinates,
from a generator that nothing else draws from or reseeds. Its state is part of the checkpoint
so a resumed run draws exactly the noise an uninterrupted run would have drawn.

``secure=True`` seeds the generator from the OS's cryptographic source (``secrets``): the noise
is then not reproducible from the run seed, which is what a deployment wants. (PyTorch's
Mersenne Twister itself is not a CSPRNG; a fully cryptographic sampler is future work.)

Every draw is standard normal, scaled by the std as it is added (:math:`x + \sigma z`), so a draw
can be started before its std is known (:meth:`GaussianNoise.prefetch_`): on a background thread,
while the clients train or already during the previous round's tail. The same generator, the same
single draw, consumed by the next :meth:`add_`: the released values and the generator state are
bit-identical to drawing at release time. A checkpoint taken while a draw is pending holds the
state before it, so a resumed run draws exactly that vector again.

The server's noise is a :class:`NoiseStream` injected into the mechanism
(:class:`~fedprivacy.privacy.mechanism.GaussianMechanism`, ``noise_stream=``): what release ``k`` adds,
its marginal std relative to ``z C`` (what DP-FedAdamBC's Phi and the reports read) and the event the
ledger composes for it. :class:`GaussianNoise`, independent ``N(0, z^2 C^2 I)`` every release, is the
default; a stream whose draw depends on earlier releases (DP-FTRL's tree, banded matrix factorization,
BLT) keeps that state and checkpoints it in its ``state_dict``.
"""

from __future__ import annotations

import hashlib
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from fedprivacy.privacy.events import AccountedEvent

NOISE_STREAM = 0x6E6F697365  # "noise": keeps this stream disjoint from other seeded stages


def torch_seed(seq: np.random.SeedSequence) -> int:
    """A seed for ``torch.Generator.manual_seed`` from ``seq``: its first 64-bit word, shifted to 63 bits."""
    return int(seq.generate_state(1, np.uint64)[0] >> 1)


def draw_id(generator_state: Any) -> str:
    """A short fingerprint of the generator state a draw starts from (same state, same draw)."""
    return hashlib.sha256(np.asarray(generator_state).tobytes()).hexdigest()[:32]


class NoiseStream(Protocol):
    r"""The server's noise over a run's releases, numbered ``1, 2, ...`` as the ledger composes them
    (module docstring): release ``k`` is :math:`\sum_i \mathrm{clip}_C(u_i) + n_k`, the noise :math:`n_k` of
    marginal std :math:`z C f(k)` per coordinate, :math:`f` = :meth:`std_factor`, accounted as :meth:`event`
    (for noise correlated across releases, the event covers the whole sequence :math:`n_1, n_2, \dots`: the
    matrix mechanism's :class:`~fedprivacy.privacy.accounting.MatrixMechanismRun`, Denisov et al. 2022,
    arXiv:2202.08312, Sec. 2).

    To implement one: a class with these methods, or a subclass of :class:`GaussianNoise` overriding
    :meth:`std_factor` and :meth:`event` (``tests/engine/test_custom_noise_stream.py``'s ``DoublingNoise``:
    std ``2 z C`` on even releases, with its own event type). It is built as
    ``factory(seed, device=..., secure=...)`` (:class:`GaussianNoise`'s signature; ``secure``: seeded from the
    OS, not ``seed``), again with a new seed after a resume that re-runs released rounds (its releases then
    count from 1 again); pass the factory as ``DPFedAvg(noise_stream=...)`` or
    ``GaussianMechanism(noise_stream=...)``, or name it ``module:factory`` in ``privacy.noise_stream``. A
    stream other than :class:`GaussianNoise` itself needs central placement and a fixed clip. :meth:`event`
    returns a registered event (:class:`~fedprivacy.privacy.events.AccountedEvent`,
    :func:`~fedprivacy.privacy.events.register_event`) that holds for what :meth:`add_` adds; the mechanism
    checkpoints :meth:`state_dict`. Optional: ``check_schedule(kind, separation)`` raises ValueError for a
    participation schedule its accounting does not hold for; ``describe_strategy()`` returns what
    ``noise_mechanism.json`` records of it; a factory's ``describe()`` names it in settings and saved states
    (:func:`stream_name`)."""

    def std_factor(self, release: int) -> float:
        """The std of release ``release``'s noise on the sum, per coordinate, in units of ``z C``."""

    def event(self, sampled: AccountedEvent, release: int) -> AccountedEvent:
        """What release ``release`` is accounted as, given the independent-Gaussian event of its sampler."""

    def prefetch_(self, like: torch.Tensor) -> None:
        """Start the next :meth:`add_`'s draw early (or do nothing)."""

    def add_(self, target: torch.Tensor, std: float) -> None:
        """Add this release's noise to ``target`` in place; ``std`` is ``z_v C std_factor(release)``."""

    def draw_id(self) -> str:
        """A fingerprint of the draw the next :meth:`add_` makes (the release log refuses a reused one)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def stream_name(factory: Any) -> str:
    """How settings and messages name a plug-in factory (a noise stream's; a participation schedule's or a server
    optimizer's too): its ``describe()`` (a parameterized spec such as
    :class:`~fedprivacy.privacy.correlated.CorrelatedMechanism`), else ``module:qualname``."""
    describe = getattr(factory, "describe", None)
    if callable(describe):
        return f"{type(factory).__module__}:{describe()}"
    return f"{factory.__module__}:{getattr(factory, '__qualname__', repr(factory))}"


def part_name(part: str | Any) -> str:
    """How settings and messages name a part given by its built-in name (kept as is) or as a factory
    (:func:`stream_name`)."""
    return part if isinstance(part, str) else stream_name(part)


class _Pending(NamedTuple):
    """A prefetched draw: its future, what it is shaped like, and the generator's state before it."""

    draw: Future
    shape: torch.Size
    dtype: torch.dtype
    state_before: torch.Tensor


class GaussianNoise:
    """Dedicated generator for the server's Gaussian noise: independent ``N(0, z^2 C^2 I)`` every release
    (the default :class:`NoiseStream`)."""

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
        self._pending: _Pending | None = None
        self._worker: ThreadPoolExecutor | None = None

    def std_factor(self, release: int) -> float:
        """1: every release's noise has std ``z C``."""
        return 1.0

    def event(self, sampled: AccountedEvent, release: int) -> AccountedEvent:
        """The sampler's event itself (an independent subsampled Gaussian)."""
        return sampled

    def describe_strategy(self) -> dict[str, Any]:
        """The strategy is the identity (``noise_mechanism.json``): every release's noise is its own draw."""
        return {"kind": "independent", "strategy": "identity: every release's noise is independent of the others'"}

    def draw_id(self) -> str:
        """A fingerprint of the generator state the next draw starts from."""
        return draw_id(self.state_dict()["generator"])

    def _draw(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(like).normal_(0.0, 1.0, generator=self._gen)

    def prefetch_(self, like: torch.Tensor) -> None:
        """Start the next :meth:`add_`'s draw (``like``'s shape, dtype and device) on a background
        thread; nothing if that draw is already pending. Only for a draw that WILL be made next with
        a nonzero std: the generator advances now, so :meth:`add_` refuses anything else rather than
        shift the stream."""
        if self._pending is not None:
            if (self._pending.shape, self._pending.dtype) != (like.shape, like.dtype):
                raise RuntimeError(f"a noise draw of shape {tuple(self._pending.shape)} is already prefetched and "
                                   "not yet consumed")
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noise")
        before = self._gen.get_state()
        self._pending = _Pending(self._worker.submit(self._draw, like), like.shape, like.dtype, before)

    def add_(self, target: torch.Tensor, std: float) -> None:
        """Add ``N(0, std^2)`` to every coordinate of ``target`` in place (one dense draw; none when std is 0)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            noise = pending.draw.result()
            if (pending.shape, pending.dtype) != (target.shape, target.dtype) or std == 0.0:
                raise RuntimeError(f"prefetched noise (shape {tuple(pending.shape)}) does not match this draw "
                                   f"(std {std}, shape {tuple(target.shape)})")
        elif std == 0.0:
            return
        else:
            noise = self._draw(target)
        target.add_(noise, alpha=std)

    def state_dict(self) -> dict:
        """The generator's state; while a prefetched draw is pending, the state before it (a resumed
        run draws that vector again, as the uninterrupted run releases it)."""
        state = self._gen.get_state() if self._pending is None else self._pending.state_before
        return {"generator": state, "secure": self.secure}

    def load_state_dict(self, state: dict) -> None:
        if self._pending is not None:
            raise RuntimeError("cannot restore the noise generator while a prefetched draw is unconsumed")
        self._gen.set_state(state["generator"])
        self.secure = bool(state["secure"])
