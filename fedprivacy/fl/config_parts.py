"""The strategy's parts (:mod:`fedprivacy.fl.parts`) from a run's config, each from the section it is set in, so an
option is read once on its way in: ``privacy`` gives the participation, the bounding (with ``client.sample_dp``:
record-level DP), the noise, the aggregation and the accounting; ``server`` the server step. A field naming a plug-in
(``package.module:factory``, :func:`~fedprivacy.config.plugins`) is imported here (:func:`plugin_factory`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from fedprivacy.config import ConfigError, MicroAdamConfig, RunConfig
from fedprivacy.fl.aggregation import Aggregation, SecureAggregationPart
from fedprivacy.fl.parts import Accounting, Bounding, Noise, Participation, ServerStepPart
from fedprivacy.fl.secure_aggregation import SecureAggregation
from fedprivacy.privacy.correlated import CorrelatedMechanism
from fedprivacy.privacy.mechanism import AdaptiveClipping, NoiseStreamFactory
from fedprivacy.privacy.noise import GaussianNoise


def plugin_factory(field: str, spec: str) -> Any:
    """The factory a plug-in field (:func:`~fedprivacy.config.plugins`) names as ``module:attribute``.

    Raises:
        ConfigError: it cannot be imported, or is not callable (naming the field).
    """
    module, _, name = spec.partition(":")
    try:
        factory: Any = importlib.import_module(module)
        for part in name.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{field}={spec!r} cannot be imported: {err}") from None
    if not callable(factory):
        raise ConfigError(f"{field}={spec!r} is not a callable factory")
    return factory


def named_or_plugin(field: str, value: str) -> Any:
    """A built-in part's name as it is, a plug-in's (``module:factory``) factory."""
    return plugin_factory(field, value) if ":" in value else value


def noise_stream_of(cfg: RunConfig) -> NoiseStreamFactory:
    """The run's noise-stream factory: ``privacy.mechanism`` (a :class:`CorrelatedMechanism` over ``horizon`` or
    ``rounds`` releases; BandMF under cyclic Poisson amplified) or ``privacy.noise_stream`` (None: independent
    Gaussian noise)."""
    p, m = cfg.privacy, cfg.privacy.mechanism
    if m.kind == "independent":
        return GaussianNoise if p.noise_stream is None else plugin_factory("privacy.noise_stream", p.noise_stream)
    return CorrelatedMechanism(kind=m.kind, horizon=m.horizon or cfg.rounds, groups=p.groups, bands=m.bands,
                               buffers=m.buffers, amplified=m.kind == "bandmf" and p.sampling == "cyclic_poisson")


def server_optimizer_settings(cfg: RunConfig, model: torch.nn.Module) -> dict[str, Any]:
    """The configured server optimizer's settings (:func:`~fedprivacy.optim.factory.make_server_optimizer`);
    DP-FedAdamBC's Phi, unless given, comes from the mechanism (:class:`~fedprivacy.fl.strategy.DPFedAvg`)."""
    s = cfg.server
    settings: dict[str, Any] = {k: getattr(s, k) for k in s.explicit_settings()}
    if s.optimizer == "microadam":
        m = s.microadam or MicroAdamConfig()
        settings["microadam"] = {
            "density": m.density, "ring_size": m.ring_size, "bucket_size": m.bucket_size,
            "stochastic_rounding": m.stochastic_rounding, "seed": cfg.seed, "device": cfg.device,
            "per_tensor_sizes": [q.numel() for q in model.parameters()] if m.per_tensor else None,
        }
    return settings


def participation_of(cfg: RunConfig, population: int) -> Participation:
    """``privacy.expected_cohort``, ``sampling`` and ``groups`` over ``population`` users."""
    p = cfg.privacy
    return Participation(p.expected_cohort, population, named_or_plugin("privacy.sampling", p.sampling), p.groups)


def bounding_of(cfg: RunConfig) -> Bounding:
    """``privacy.clip_norm`` and ``adaptive_clipping``; record-level when ``client.sample_dp`` is set."""
    p, a = cfg.privacy, cfg.privacy.adaptive_clipping
    adaptive = None if a is None else AdaptiveClipping(a.target_quantile, a.learning_rate, p.count_stddev)
    return Bounding(p.clip_norm, adaptive, record_level=cfg.client.sample_dp is not None)


def noise_of(cfg: RunConfig) -> Noise:
    """``privacy.noise_multiplier`` (resolved), ``placement``, the noise stream, the run seed unless
    ``secure_noise``, and the large-cohort emulation."""
    p = cfg.privacy
    assert p.noise_multiplier != "auto", "resolve_noise_multiplier first"
    return Noise(p.noise_multiplier, p.placement, noise_stream_of(cfg), None if p.secure_noise else cfg.seed,
                 p.noise_cohort, p.noise_population)


def aggregation_of_config(cfg: RunConfig) -> Aggregation | None:
    """``privacy.aggregation``'s plug-in (``factory()``), SecAgg+ for ``privacy.secure_aggregation``, or None (the
    plain sum)."""
    p = cfg.privacy
    if p.aggregation is not None:
        aggregation: Aggregation = plugin_factory("privacy.aggregation", p.aggregation)()
        return aggregation
    sa = p.secure_aggregation
    return None if sa is None else SecureAggregationPart(SecureAggregation(sa.threshold, sa.neighbours, sa.bits,
                                                                           sa.timeout_s))


def server_step_of(cfg: RunConfig, model: torch.nn.Module) -> ServerStepPart:
    """``server.optimizer``, ``lr``, its settings for ``model`` and ``disk``."""
    s = cfg.server
    return ServerStepPart(named_or_plugin("server.optimizer", s.optimizer), s.lr, server_optimizer_settings(cfg, model),
                          s.disk.kappa if s.disk else None, s.disk.gamma if s.disk else 0.5)


def accounting_of(cfg: RunConfig) -> Accounting:
    """``privacy.delta``, ``target_epsilon``, ``budget_accountant`` and ``accountants``."""
    p = cfg.privacy
    return Accounting(p.delta, p.target_epsilon, p.budget_accountant, tuple(p.accountants))
