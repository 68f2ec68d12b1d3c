"""Build a server optimizer by name, passing each one only the settings it uses.

Every server optimizer updates flat ``params`` in place from the released, noised average ``g``
(``step_(params, g)``) and checkpoints through ``state_dict()`` / ``load_state_dict()``.

=========  ==================================  ===============================================
name       class                               settings read (None = the class's default)
=========  ==================================  ===============================================
sgd        :class:`ServerSGD`                  momentum
adam       :class:`ServerAdam`                 beta1, beta2, tau, bias_correction
yogi       :class:`ServerYogi`                 beta1, beta2, tau, bias_correction
adagrad    :class:`ServerAdagrad`              beta1, tau
adambc     :class:`ServerAdamBC`               beta1, beta2, bias_correction (as ``corrected_v``),
                                               phi (required), gamma_prime (default
                                               :func:`default_gamma_prime`)
microadam  :class:`ServerMicroAdam`            beta1, beta2, tau (as ``eps``), microadam (options)
=========  ==================================  ===============================================

A setting the named optimizer does not read must be None: it is refused, never silently dropped
(e.g. ``momentum`` with ``adam``, whose momentum is ``beta1``). ``bias_correction=None`` keeps each
paper's choice: off for adam/yogi (Reddi et al. Alg. 2), on for adambc (Tang et al. Alg. 1).
The classes themselves remain the primary API; this is the entry point for configs.

A server optimizer of one's own is a :data:`ServerOptimizerFactory`, called as ``factory(lr, **settings)`` (as the
built-in classes are: ``ServerSGD`` is ``sgd``'s) and built by :func:`build_server_optimizer`, the one place that
builds either; it implements :class:`ServerOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import torch

from fedprivacy.optim.adambc import ServerAdamBC
from fedprivacy.optim.fedopt import ServerAdagrad, ServerAdam, ServerYogi
from fedprivacy.optim.microadam import ServerMicroAdam
from fedprivacy.optim.server_sgd import ServerSGD

OptimizerName = Literal["sgd", "adam", "yogi", "adagrad", "adambc", "microadam"]


class ServerOptimizer(Protocol):
    """What the server needs from an optimizer (:class:`~fedprivacy.optim.server_step.ServerStep` calls it after
    every release, on released values only: post-processing, invariant 6). Optional: ``set_phi(phi)``, called first
    with Phi_t, the per-coordinate noise variance of what ``step_`` is fed (DP-FedAdamBC subtracts it; under DiSK
    the filter's); ``downlink_bytes()``, the bytes of ``x_{t+1} - x_t`` the broadcast needs when sparse."""

    def step_(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        """``params`` (flat ``x_t``) becomes ``x_{t+1}`` in place from the released ``pseudo_grad`` (``g_t``, which
        the server ADDS: ``x + g`` is FedAvg's step)."""

    def state_dict(self) -> dict:
        """Its state, checkpointed after every round (tensors and plain values)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a resume)."""


ServerOptimizerFactory = Callable[..., ServerOptimizer]
"""``factory(lr, **settings)``: a fresh :class:`ServerOptimizer` with learning rate ``lr`` and the settings given
(``DPFedAvg(optimizer_settings=...)``; from a config, the ``server`` settings that are set)."""


# name -> (class, {factory argument: constructor argument})
_BUILDERS: dict[str, tuple[type, dict[str, str]]] = {
    "sgd": (ServerSGD, {"momentum": "momentum"}),
    "adam": (ServerAdam, {"beta1": "beta1", "beta2": "beta2", "tau": "tau", "bias_correction": "bias_correction"}),
    "yogi": (ServerYogi, {"beta1": "beta1", "beta2": "beta2", "tau": "tau", "bias_correction": "bias_correction"}),
    "adagrad": (ServerAdagrad, {"beta1": "beta1", "tau": "tau"}),
    "adambc": (ServerAdamBC, {"beta1": "beta1", "beta2": "beta2", "bias_correction": "corrected_v",
                              "gamma_prime": "gamma_prime", "phi": "phi"}),
    # ``microadam`` holds ServerMicroAdam's own options (density, ring_size, ...), passed through
    "microadam": (ServerMicroAdam, {"beta1": "beta1", "beta2": "beta2", "tau": "eps", "microadam": "**"}),
}
_REQUIRED = {"adambc": ("phi",)}


def default_gamma_prime(phi: float) -> float:
    """DP-FedAdamBC's γ′ when none is set: ``0.01 Phi`` (inside the paper's tuned range, about 0.004 Phi
    to 0.84 Phi; Tang et al. 2024, arXiv:2312.14334v1, App. A), or ``1e-12`` without noise (Phi = 0)."""
    return 0.01 * phi if phi > 0 else 1e-12


def make_server_optimizer(
    name: OptimizerName,
    *,
    lr: float,
    momentum: float | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    tau: float | None = None,
    bias_correction: bool | None = None,
    gamma_prime: float | None = None,
    phi: float | None = None,
    microadam: Mapping[str, Any] | None = None,
) -> ServerOptimizer:
    """The server optimizer ``name`` with learning rate ``lr`` and the settings it reads.

    Args:
        name: one of ``sgd``, ``adam``, ``yogi``, ``adagrad``, ``adambc``, ``microadam``.
        lr: server learning rate η.
        momentum: heavy-ball momentum (sgd only).
        beta1: first-moment decay β₁ (adaptive optimizers).
        beta2: second-moment decay β₂ (adam, yogi, adambc).
        tau: adaptivity τ, outside the root (adam, yogi, adagrad).
        bias_correction: Adam-style bias correction (adam, yogi; ``corrected_v`` for adambc).
        gamma_prime: γ′, the floor under ``v_hat - Phi`` (adambc; default :func:`default_gamma_prime`).
        phi: Φ from :func:`fedprivacy.privacy.placement.dp_noise_variance` (adambc, required).
        microadam: keyword options of :class:`~fedprivacy.optim.microadam.ServerMicroAdam`
            (microadam only; ``tau`` is its ``eps``).

    Returns:
        A fresh optimizer with empty state.

    Raises:
        ValueError: on an unknown ``name``, a setting ``name`` does not read, or a missing
            required one; the message names the setting.
    """
    given = {"momentum": momentum, "beta1": beta1, "beta2": beta2, "tau": tau, "bias_correction": bias_correction,
             "gamma_prime": gamma_prime, "phi": phi, "microadam": microadam}
    check_settings(name, {k for k, v in given.items() if v is not None})
    if name == "adambc" and gamma_prime is None:
        given["gamma_prime"] = default_gamma_prime(phi)
    cls, reads = _BUILDERS[name]
    kwargs = {reads[k]: v for k, v in given.items() if v is not None}
    return cls(lr, **kwargs.pop("**", {}), **kwargs)


def check_settings(name: str, given: set[str]) -> None:
    """Raise ``ValueError`` naming any setting in ``given`` that ``name`` does not read, or a missing one."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown server optimizer {name!r}; choose one of {sorted(_BUILDERS)}")
    reads = _BUILDERS[name][1]
    unused = sorted(k for k in given if k not in reads)
    if unused:
        raise ValueError(f"server optimizer {name!r} does not use {', '.join(unused)}; leave it unset "
                         f"({name!r} reads: {', '.join(reads) or 'nothing but lr'})")
    missing = [k for k in _REQUIRED.get(name, ()) if k not in given]
    if missing:
        raise ValueError(f"server optimizer {name!r} requires {', '.join(missing)}")


def build_server_optimizer(optimizer: OptimizerName | ServerOptimizerFactory, lr: float,
                           settings: Mapping[str, Any], phi: float | None = None) -> ServerOptimizer:
    """The optimizer named (:func:`make_server_optimizer`) or ``optimizer(lr, **settings)`` for a factory.

    ``phi``: Phi_0, the noise variance per coordinate of the first release (the mechanism's
    :meth:`~fedprivacy.privacy.mechanism.GaussianMechanism.phi`), given to a named optimizer that requires it at
    construction (``adambc``) unless ``settings`` sets it; later rounds' Phi_t reach it through ``set_phi``
    (:class:`~fedprivacy.optim.server_step.ServerStep`).

    Raises:
        ValueError: naming the setting or the factory that refuses them.
    """
    if isinstance(optimizer, str):
        needs_phi = phi is not None and "phi" in _REQUIRED.get(optimizer, ())
        return make_server_optimizer(optimizer, lr=lr, **{**({"phi": phi} if needs_phi else {}), **settings})
    try:
        return optimizer(lr, **settings)
    except TypeError as err:
        raise ValueError(f"server optimizer {getattr(optimizer, '__qualname__', optimizer)!r} refuses lr={lr!r} and "
                         f"the settings {dict(settings)!r}: {err}") from None
