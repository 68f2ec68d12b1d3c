"""The run's fedprivacy config as Flower delivers it to the ServerApp and ClientApp (``flwr run``).

Kept apart from the apps so that a ClientApp process (one per message under Flower's deployment
runtime) imports no server-side modules.
"""

from __future__ import annotations

from flwr.app import Context

from fedprivacy.config import RunConfig, config_from_json, load_config


def config_from_context(context: Context) -> tuple[RunConfig, bool]:
    """Read the run's config from Flower's run config (``flwr run --run-config``)."""
    rc = context.run_config
    if rc.get("config-json"):
        cfg = config_from_json(str(rc["config-json"]))
    elif rc.get("config-yaml"):
        cfg = load_config(str(rc["config-yaml"]))
    else:
        raise ValueError("run config needs 'config-yaml' (path to a fedprivacy YAML config) or 'config-json'")
    return cfg, bool(rc.get("resume", False))
