"""What the privacy accountants can compute: the range every event, delta and reported epsilon stays in.

Outside these bounds the backends of :mod:`fedprivacy.privacy.accounting` fail or stall (measured,
dp_accounting 0.6 and Opacus 1.5 on CPU): Opacus' RDP raises ``OverflowError`` at z = 1e300 and
``ZeroDivisionError`` at z = 1e-300; dp_accounting's PLD asks for more memory than exists
("Maximum allowed size exceeded") at z = 1e-30 and fails at q = 1e-319; Opacus' PRV raises at
z = 0.02, q = 1 and at delta = 1e-300. Settings of a run outside them are refused before anything is
released (the config, :class:`~fedprivacy.privacy.mechanism.GaussianMechanism`,
:func:`~fedprivacy.privacy.accounting.resolve_delta`); a client's reported event is moved inside them
on the side that can only raise its epsilon (:func:`~fedprivacy.privacy.client_ledgers.event_from_metrics`).

This module imports nothing, so the config layer can validate against the same numbers.
"""

MIN_NOISE_MULTIPLIER = 2.0 ** -6
r"""Smallest non-zero z an event may have (:mod:`fedprivacy.privacy.accounting`, "Accountable range"): one unsampled round
at z = 1/64 already has :math:`\varepsilon \approx 1/(2z^2) > 2000`, and PLD grids grow like
:math:`1/z^2` (at z = 1e-3 one ``pld`` evaluation did not finish in 5 minutes)."""

MAX_NOISE_MULTIPLIER = 2.0 ** 20
r"""Largest z an event may have. RDP's ε does not vanish as z → ∞: with no RDP left it tends to
:math:`\min_\alpha \log\frac{\alpha-1}{\alpha} - \frac{\log\delta + \log\alpha}{\alpha-1}`
(0.1029 at δ = 1e-5 with Opacus' orders, whose largest is 63); PRV's tends to its additive
``PRV_EPS_ERROR`` (0.01); larger z changes nothing but overflows ``z ** 2``."""

MIN_SAMPLING_RATE = 1e-12
"""Smallest non-zero sampling rate q an event may have (PLD fails on subnormal rates)."""

MIN_DELTA = 1e-10
"""Smallest delta an epsilon is computed at (Opacus' PRV refuses deltas near its float resolution)."""

MAX_NOISE_STD = 3.4028234663852886e38 ** 0.5
"""Largest clip norm, noise multiplier and noise std ``z C`` on the sum: their squares (the noise's variance)
stay finite in float32, the models' dtype (``z C`` = 1e39 overflows the draw itself)."""

EPSILON_CEILING = 100.0
"""Above this RDP ε, ``prv`` and ``pld`` report ``inf`` without building a grid
(:mod:`fedprivacy.privacy.accounting`, "Accountable range")."""


def check_noise_std(noise_multiplier: float, clip_norm: float, prefix: str = "") -> None:
    """The one rule on the noise std on the sum, ``z C`` <= :data:`MAX_NOISE_STD` (the config and
    :class:`~fedprivacy.privacy.mechanism.GaussianMechanism` both apply it; ``prefix`` names their section).

    Raises:
        ValueError: ``z C`` is larger, naming both settings.
    """
    if noise_multiplier * clip_norm > MAX_NOISE_STD:
        raise ValueError(f"{prefix}noise_multiplier * {prefix}clip_norm = {noise_multiplier * clip_norm:g} (the noise "
                         f"std on the sum) must be <= {MAX_NOISE_STD:.3g}: its square overflows float32")
