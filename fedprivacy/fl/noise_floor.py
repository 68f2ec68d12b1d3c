r"""A deployed client's noise floor: the least privacy its own noise share may carry, set by its operator.

Under the client-side placements (``distributed``, ``local``, and secure aggregation) each client clips its
update and adds its own noise, and the settings that size that noise come from the run config. On a real
SuperNode (fedprivacy's ClientApp with ``cfg`` None) that run config is the SERVER's: a server sending
``noise-multiplier=0.015625`` would cut each share's std 64x, and the shares are what protects the client
from that very server. So the client holds the server's settings against a floor from its own node config
(``flower-supernode --node-config "noise-multiplier-floor=1.0 expected-cohort-ceiling=100"``) and refuses
to train below it (:func:`enforce`). The public mods (:func:`~fedprivacy.fl.mods.client_noise_mod`,
:func:`~fedprivacy.fl.secure_aggregation.secure_aggregation_mod`) take their settings from the client's code
and need no floor; a simulation bound to its config by fedprivacy's own engines needs none either (the
client's config IS the run's).

Node config keys (:data:`NODE_KEYS`), each bounding one server setting:

- ``noise-multiplier-floor``: :math:`z_{\min} > 0` (every client-side placement);
- ``expected-cohort-ceiling``: :math:`m_{\max} \ge 1`, the largest cohort the share may be split for
  (``distributed``, secure aggregation);
- ``bits-floor``: :math:`b_{\min}`, the fewest bits of the secure aggregation modulus (secure aggregation).

The rule: the client uses the server's settings as they are when :math:`z \ge z_{\min}`,
:math:`m \le m_{\max}` and :math:`b \ge b_{\min}` (those its placement uses), and refuses otherwise; a request
for more noise is followed. Each comparison alone never weakens the client's share:

- Gaussian share (:mod:`fedprivacy.privacy.placement`): :math:`\operatorname{clip}(u, C) + \mathcal N(0, s^2)`
  with :math:`s = zC/\sqrt m` (``local``: :math:`zC`) is a Gaussian mechanism of sensitivity C and noise
  multiplier :math:`s / C = z / \sqrt m`: larger z or smaller m, more privacy.
- Skellam share (:mod:`fedprivacy.privacy.skellam`; Agarwal, Kairouz, Liu 2021, arXiv:2110.04995, Thm. 3.5):
  in scaled units the share has variance :math:`\mu_1 = z^2 (Cs)^2 / m` and sensitivities :math:`\Delta_2,
  \Delta_1` that grow with :math:`Cs` while :math:`\Delta_2 / Cs` falls, with
  :math:`(Cs)^2 = ((2^{b-1}/k)^2 - m/4) / (m^2/D + z^2)`. The RDP bound at any order, for any number of
  surviving shares, rises with :math:`\Delta_2^2/\mu_1`, :math:`\Delta_2^2/\mu_1^2`, :math:`\Delta_1/\mu_1^2`
  and :math:`\Delta_1/\mu_1`, and each of these falls with more bits (:math:`Cs` grows) and with a larger z
  (:math:`\mu_1` grows, :math:`Cs` shrinks) and rises with a larger m.

The clip norm C is not compared: neither share's privacy depends on it (a smaller C shrinks the clip and the
noise alike; :math:`Cs` does not depend on C), and the client clips at the very C its noise is sized for.
What the floor does not bound: the Skellam share's bound also grows with the model's dimension D (the
rounding), which the run's task sets; the record-level noise of ``client.sample_dp``.

Secure aggregation's own parameters (:class:`SecAggNode`) come from the node config too, never from the server:
``secagg-threshold`` and ``secagg-neighbours`` (the t and k the client holds every SecAgg+ message against,
:class:`~fedprivacy.fl.secure_aggregation.ClientSettings`), and optionally ``secagg-identity-key`` (a file holding
the node's EC private key, PEM or OpenSSH: a SuperNode's ``--auth-supernode-private-key`` serves) and
``secagg-roster`` (a file of trusted identity public keys, one OpenSSH line each, as ``flwr supernode register``
reads them): with a roster the server can neither invent clients nor substitute a client's keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.supercore.primitives.asymmetric import private_key_to_bytes, public_key_to_bytes

from fedprivacy.config import PrivacyConfig
from fedprivacy.fl.secure_aggregation import check_parameters
from fedprivacy.privacy.skellam import MAX_BITS, MIN_BITS

NOISE_MULTIPLIER_KEY = "noise-multiplier-floor"
EXPECTED_COHORT_KEY = "expected-cohort-ceiling"
BITS_KEY = "bits-floor"
NODE_KEYS = (NOISE_MULTIPLIER_KEY, EXPECTED_COHORT_KEY, BITS_KEY)
"""The node config keys of the floor (module docstring)."""
THRESHOLD_KEY = "secagg-threshold"
NEIGHBOURS_KEY = "secagg-neighbours"
IDENTITY_KEY = "secagg-identity-key"
ROSTER_KEY = "secagg-roster"


class NoiseFloorError(ValueError):
    """A node config floor that is invalid or missing, or a server's setting below it: one line naming the key."""


def _number(node_config: Mapping[str, Any], key: str, integer: bool) -> Any:
    """``node_config[key]`` checked as a finite number (an integer when ``integer``), None when absent."""
    raw = node_config.get(key)
    if raw is None:
        return None
    number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    if integer and number and isinstance(raw, int):
        return raw
    if not integer and number:
        try:
            value = float(raw)
        except OverflowError:  # an integer beyond float's range
            value = math.inf
        if math.isfinite(value):
            return value
    kind = "an integer" if integer else "a finite number"
    raise NoiseFloorError(f"node config {key} must be {kind}, got {raw!r}")


@dataclass(frozen=True)
class NoiseFloor:
    """A client's floor from its node config (module docstring); a field is None where its key is not set."""

    noise_multiplier: float | None = None
    expected_cohort: int | None = None
    bits: int | None = None

    def __post_init__(self) -> None:
        for key, value, ok, bound in (
                (NOISE_MULTIPLIER_KEY, self.noise_multiplier, lambda v: v > 0, "> 0"),
                (EXPECTED_COHORT_KEY, self.expected_cohort, lambda v: v >= 1, ">= 1"),
                (BITS_KEY, self.bits, lambda v: MIN_BITS <= v <= MAX_BITS, f"in [{MIN_BITS}, {MAX_BITS}]")):
            if value is not None and not ok(value):
                raise NoiseFloorError(f"node config {key} must be {bound}, got {value!r}")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NoiseFloor:
        """The floor a SuperNode's ``--node-config`` sets (its other keys ignored); clear errors for bad values."""
        return cls(_number(node_config, NOISE_MULTIPLIER_KEY, integer=False),
                   _number(node_config, EXPECTED_COHORT_KEY, integer=True),
                   _number(node_config, BITS_KEY, integer=True))


def _file(node_config: Mapping[str, Any], key: str) -> tuple[Path, bytes] | None:
    """The path ``node_config[key]`` names and the file's bytes; None when the key is absent."""
    raw = node_config.get(key)
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw:
        raise NoiseFloorError(f"node config {key} must name a file, got {raw!r}")
    try:
        return Path(raw), Path(raw).read_bytes()
    except OSError as err:
        raise NoiseFloorError(f"node config {key}: cannot read {raw} ({err.strerror or err})") from None


def _identity_key(node_config: Mapping[str, Any]) -> bytes | None:
    """The node's identity signing key from the file ``secagg-identity-key`` names (PEM or OpenSSH EC), as PEM."""
    found = _file(node_config, IDENTITY_KEY)
    if found is None:
        return None
    path, data = found
    for load in (serialization.load_ssh_private_key, serialization.load_pem_private_key):
        try:
            key = load(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return private_key_to_bytes(key)
    raise NoiseFloorError(f"node config {IDENTITY_KEY}: {path} holds no unencrypted EC private key (PEM or OpenSSH)")


def _roster(node_config: Mapping[str, Any]) -> frozenset[bytes] | None:
    """The trusted identity public keys (PEM) from the file ``secagg-roster`` names: one OpenSSH public key per
    line (blank lines and ``#`` comments skipped)."""
    found = _file(node_config, ROSTER_KEY)
    if found is None:
        return None
    path, data = found
    keys = set()
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            key = serialization.load_ssh_public_key(line.strip().encode())
        except (ValueError, TypeError, UnsupportedAlgorithm):
            key = None
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise NoiseFloorError(f"node config {ROSTER_KEY}: {path} line {number} is not an OpenSSH EC public key")
        keys.add(public_key_to_bytes(key))
    if not keys:
        raise NoiseFloorError(f"node config {ROSTER_KEY}: {path} lists no key")
    return frozenset(keys)


@dataclass(frozen=True)
class SecAggNode:
    """A deployed client's own SecAgg+ parameters from its node config (module docstring): what it holds the
    server's messages against, never what the server's run config says."""

    threshold: int
    neighbours: int
    identity_key: bytes | None = None
    roster: frozenset[bytes] | None = None

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> SecAggNode:
        """Read ``secagg-threshold`` and ``secagg-neighbours`` (required: a client without them refuses to run the
        protocol), ``secagg-identity-key`` and ``secagg-roster`` (optional files); one line naming the key."""
        threshold = _number(node_config, THRESHOLD_KEY, integer=True)
        neighbours = _number(node_config, NEIGHBOURS_KEY, integer=True)
        if threshold is None or neighbours is None:
            raise NoiseFloorError(f"a deployed client runs secure aggregation only with its own parameters: set "
                                  f"{THRESHOLD_KEY} and {NEIGHBOURS_KEY} in its node config (flower-supernode "
                                  "--node-config)")
        try:
            check_parameters(threshold, neighbours, f"node config {THRESHOLD_KEY}/{NEIGHBOURS_KEY}")
        except ValueError as err:
            raise NoiseFloorError(str(err)) from None
        return cls(threshold, neighbours, _identity_key(node_config), _roster(node_config))


def floor_node_config(privacy: PrivacyConfig) -> dict[str, Any]:
    """The node config keys that set the floor to exactly ``privacy``'s settings (none under central placement),
    and secure aggregation's threshold and neighbours: what a deployment that trusts its own run config gives each
    SuperNode (its identity key and roster files are per node: :mod:`fedprivacy.deploy.local` adds them)."""
    if privacy.placement == "central":  # (secure aggregation needs distributed placement)
        return {}
    if privacy.noise_multiplier == "auto":
        raise NoiseFloorError(f"privacy.placement={privacy.placement!r} needs a given privacy.noise_multiplier for a "
                              f"deployment: each SuperNode's {NOISE_MULTIPLIER_KEY} is set from it")
    out: dict[str, Any] = {NOISE_MULTIPLIER_KEY: float(privacy.noise_multiplier)}
    if privacy.placement == "distributed":
        out[EXPECTED_COHORT_KEY] = privacy.expected_cohort
    if privacy.secure_aggregation is not None:
        sa = privacy.secure_aggregation
        out.update({BITS_KEY: sa.bits, THRESHOLD_KEY: sa.threshold, NEIGHBOURS_KEY: sa.neighbours})
    return out


def enforce(floor: NoiseFloor, privacy: PrivacyConfig) -> None:
    """Refuse the server's ``privacy`` settings unless, for those the client's placement uses,
    ``noise_multiplier >= floor.noise_multiplier`` (every client-side placement), ``expected_cohort <=
    floor.expected_cohort`` (distributed, secure aggregation) and ``secure_aggregation.bits >= floor.bits``
    (secure aggregation, which needs distributed placement); the client then uses them as they are. Central
    placement (the client adds no noise) is never refused. A floor key the placement needs but the node config
    lacks is refused too, naming the key.

    Raises:
        NoiseFloorError: one line naming the server's setting and the node config key it falls below (or the
            missing key).
    """
    secure = privacy.secure_aggregation
    if privacy.placement == "central":
        return
    where = "secure aggregation" if secure is not None else f"placement={privacy.placement}"
    z = privacy.noise_multiplier
    checks: list[tuple[str, Any, str, Any, bool]] = [
        ("noise-multiplier", z, NOISE_MULTIPLIER_KEY, floor.noise_multiplier,
         floor.noise_multiplier is not None and z != "auto" and z >= floor.noise_multiplier)]
    if privacy.placement == "distributed":
        checks.append(("expected-cohort", privacy.expected_cohort, EXPECTED_COHORT_KEY, floor.expected_cohort,
                       floor.expected_cohort is not None and privacy.expected_cohort <= floor.expected_cohort))
    if secure is not None:
        checks.append(("bits", secure.bits, BITS_KEY, floor.bits, floor.bits is not None and secure.bits >= floor.bits))
    for setting, asked, key, bound, ok in checks:
        if bound is None:
            raise NoiseFloorError(f"a deployed client adds its own noise under {where} and refuses to train without "
                                  f"a floor: set {key} in its node config (flower-supernode --node-config)")
        if not ok:
            raise NoiseFloorError(f"client refuses the server's {setting}={asked!r}: its node config sets {key}={bound!r}")
