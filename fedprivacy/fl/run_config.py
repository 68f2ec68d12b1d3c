"""The run's fedprivacy config as Flower delivers it to the ServerApp and ClientApp (``flwr run``).

Kept apart from the apps so that a ClientApp process (one per message under Flower's deployment
runtime) imports no server-side modules.

Flower's run config (``[tool.flwr.app.config]`` in pyproject.toml, overridden one key at a time
with ``flwr run . --run-config "num-server-rounds=3 noise-multiplier=0.5"``) becomes a
:class:`RunConfig` in three layers:

1. the base: ``config-json`` (a serialised RunConfig) if set, else the YAML file ``config-yaml`` if
   set, else the embedded defaults (``configs/quickstart.yaml`` spells them out);
2. the typed keys of :data:`RUN_CONFIG_KEYS`, each mapped onto one RunConfig field. Without a base
   file every key is applied. With one, a key is applied only where its value differs from the
   default declared here (Flower hands the app its defaults and the overrides already fused, so a
   key left at its default must not undo the file's value);
3. validation, whose errors name the run-config key as well as the field.

A config naming a plug-in (``module:factory``: code the ServerApp and every ClientApp would import and call) is
refused unless the run config says ``allow-plugins = true``: the opt-in of whoever starts the run (``flwr run
--run-config``, or ``fedprivacy deploy local --allow-plugins``), never of the config file or JSON it names.

An unknown key is an error naming it (Flower itself refuses ``--run-config`` keys the app does not
declare; this catches a pyproject that declares one the code does not know).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from flwr.app import Context

from fedprivacy.config import ConfigError, RunConfig, build_config, check_plugins, read_yaml_mapping


@dataclass(frozen=True)
class RunConfigKey:
    """One typed run-config key: the RunConfig field it sets, its type and its declared default."""

    key: str
    field: str
    type: type
    default: Any
    words: tuple[str, ...] = ()
    """Strings accepted besides values of ``type`` (``noise-multiplier = "auto"``)."""
    zero_is_none: bool = False
    """``0`` means the field's ``null`` (TOML has no null): ``num-users = 0`` is every user in the data."""

    def value(self, raw: Any) -> Any:
        """``raw`` checked against the type (an int is accepted for a float), as the field's value."""
        ok = (isinstance(raw, self.type) and not isinstance(raw, bool)) if self.type is not bool else isinstance(raw, bool)
        if self.type is float and isinstance(raw, int) and not isinstance(raw, bool):
            raw, ok = float(raw), True
        if isinstance(raw, str) and raw in self.words:
            return raw
        if not ok:
            expected = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[self.type]
            extra = "".join(f" or '{w}'" for w in self.words)
            raise ConfigError(f"run config key '{self.key}' must be {expected}{extra} (got {raw!r})")
        return None if self.zero_is_none and raw == 0 else raw


RUN_CONFIG_KEYS: tuple[RunConfigKey, ...] = (
    RunConfigKey("num-server-rounds", "rounds", int, 40),
    RunConfigKey("num-users", "data.max_clients", int, 0, zero_is_none=True),
    RunConfigKey("noise-multiplier", "privacy.noise_multiplier", float, 1.0, words=("auto",)),
    RunConfigKey("target-epsilon", "privacy.target_epsilon", float, 0.0, zero_is_none=True),
    RunConfigKey("clip-norm", "privacy.clip_norm", float, 10.0),
    RunConfigKey("expected-cohort", "privacy.expected_cohort", int, 100),
    RunConfigKey("server-optimizer", "server.optimizer", str, "sgd"),
    RunConfigKey("server-lr", "server.lr", float, 1.0),
    RunConfigKey("client-lr", "client.lr", float, 30.0),
    RunConfigKey("local-epochs", "client.epochs", int, 5),
    RunConfigKey("batch-size", "client.batch_size", int, 10),
    RunConfigKey("seed", "seed", int, 0),
    RunConfigKey("data-path", "data.path", str, "data/synthetic"),
    RunConfigKey("output-dir", "output_dir", str, "runs/quickstart"),
)
"""The typed keys; pyproject.toml's ``[tool.flwr.app.config]`` declares each with this default (a test checks)."""

BASE_KEYS: dict[str, Any] = {"config-yaml": "", "config-json": "", "resume": False, "allow-plugins": False}
"""The other declared keys: the base config file or JSON (empty: the embedded defaults), resume, and the
opt-in to plug-ins (:func:`~fedprivacy.config.check_plugins`)."""

PLUGIN_OPT_IN = '--run-config "allow-plugins=true" (flwr run) or --allow-plugins (fedprivacy deploy local)'
"""How the one who starts a run opts in to the plug-ins its config names."""

KEYS_BY_NAME = {k.key: k for k in RUN_CONFIG_KEYS}


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    for s in sections:
        tree = tree.setdefault(s, {})
    tree[leaf] = value


def config_from_run_config(rc: dict[str, Any]) -> tuple[RunConfig, bool]:
    """``(RunConfig, resume)`` from a Flower run config (a flat mapping of declared keys to values)."""
    unknown = sorted(set(rc) - set(KEYS_BY_NAME) - set(BASE_KEYS))
    if unknown:
        raise ConfigError(f"unknown run config key(s): {', '.join(repr(k) for k in unknown)} (known: "
                          f"{', '.join(sorted([*BASE_KEYS, *KEYS_BY_NAME]))})")
    if rc.get("config-json"):
        tree, source, has_base = json.loads(str(rc["config-json"])), "run config config-json", True
    elif rc.get("config-yaml"):
        tree, source, has_base = read_yaml_mapping(str(rc["config-yaml"])), f"{rc['config-yaml']}", True
    else:
        tree, source, has_base = {}, "run config", False
    applied = []
    for name, raw in rc.items():
        key = KEYS_BY_NAME.get(name)
        if key is None or (has_base and raw == key.default and type(raw) is type(key.default)):
            continue
        _set(tree, key.field, key.value(raw))
        applied.append(f"{name} -> {key.field}")
    try:
        cfg = build_config(tree, source=source + (" + run config keys" if has_base and applied else ""))
    except ConfigError as err:
        raise ConfigError(f"{err}\n  (run config keys: {'; '.join(applied)})" if applied else str(err)) from None
    resume, allow = rc.get("resume", False), rc.get("allow-plugins", False)
    for key, value in (("resume", resume), ("allow-plugins", allow)):
        if not isinstance(value, bool):
            raise ConfigError(f"run config key '{key}' must be true or false (got {value!r})")
    check_plugins(cfg, allow, opt_in=PLUGIN_OPT_IN)
    return cfg, resume


@functools.lru_cache(maxsize=8)
def _cached(items: tuple[tuple[str, Any], ...]) -> tuple[RunConfig, bool]:
    return config_from_run_config(dict(items))


def config_from_context(context: Context) -> tuple[RunConfig, bool]:
    """Read the run's config from Flower's run config (``flwr run --run-config``); cached, since the
    ClientApp asks once per message."""
    rc = dict(context.run_config)
    if rc.get("config-yaml"):  # a file may change between runs: read it each time
        return config_from_run_config(rc)
    return _cached(tuple(sorted(rc.items())))
