"""Flower's Simulation Engine (Ray backend), running the same ServerApp and ClientApp.

Each of the ``population`` virtual SuperNodes gets ``partition-id`` = its client index (the users', then
``privacy.canaries.count`` canaries', :func:`~fedprivacy.fl.canaries.population_with_canaries`). Flower
runs ClientApps in Ray actors sized by ``ray.num_cpus`` / ``ray.num_gpus`` (fractional GPUs
allowed). With ``ray.address`` set they run on that existing Ray cluster (every node with a free
``ray.num_cpus``/``ray.num_gpus`` slot hosts actors; the ServerApp stays in this process), else on
Ray's default (see :class:`~fedprivacy.config.RayConfig`). ``flwr.simulation.run_simulation`` is
deprecated upstream but is Flower's only in-Python entry to this engine; ``flwr run .`` with
``--run-config "config-yaml='...'"`` runs the same apps through a SuperLink instead.
"""

from __future__ import annotations

import logging
import warnings

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fedprivacy.config import RayConfig


def run_ray(server_app: ServerApp, client_app: ClientApp, num_nodes: int, resources: RayConfig) -> None:
    """Run the apps on Flower's Simulation Engine with ``num_nodes`` SuperNodes."""
    from flwr.simulation import run_simulation

    init_args: dict[str, object] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if resources.address is not None:  # Flower's RayBackend passes init_args on to ray.init(**init_args)
        init_args["address"] = resources.address
    backend_config = {
        "client_resources": {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus},
        "init_args": init_args,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_nodes,
                       backend_config=backend_config)
