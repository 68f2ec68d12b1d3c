"""A real two-node Ray cluster on this machine: ``ray start --head`` plus a second ``ray start
--address`` with its own resources, a simulation attached to it with ``ray.address``, ClientApps on
BOTH nodes, the same model and epsilon as the in-process engine, and the cluster stopped again.

The cluster is private to the test: both nodes live under a throwaway temp dir (``--temp-dir`` and
``RAY_TMPDIR``, so the "current cluster" file that ``ray.init()`` and ``ray stop`` look at in
/tmp/ray is never touched), every port is chosen free, and each ``ray start`` runs in its own
session, so the test stops exactly its own processes by process group. ``ray stop`` is not used:
it kills every Ray process of the machine, including other runs' local Ray instances.
"""

from __future__ import annotations

import json
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fedprivacy.run as run_module
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.run import run

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    address: str
    nodes: dict[str, dict[str, float]]  # node id -> resources
    head_id: str
    worker_id: str


def _node_args(root: str, name: str) -> list[str]:
    """One node's ``ray start`` flags: 1 CPU, a custom resource naming it, its own temp dir, free ports."""
    return [
        "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", f"--resources={json.dumps({name: 1})}",
        f"--temp-dir={root}/{name}", "--object-store-memory=100000000", "--disable-usage-stats",
        f"--node-manager-port={_free_port()}", f"--object-manager-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
        f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
    ]


def _group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (each ``ray start`` is a session leader, its GCS,
    raylet, agents and workers stay in its group)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                pids.append(int(entry.name))
    return pids


def _signal(pgids: list[int], sig: int) -> None:
    """Send ``sig`` to every live member of the groups, by pid."""
    for pgid in pgids:
        for pid in _group_members(pgid):
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(pid, sig)


def _stop(pgids: list[int], grace_s: float = 15.0) -> list[int]:
    """SIGTERM the groups (worker first), SIGKILL what is left after ``grace_s``; returns survivors."""
    _signal(pgids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_members(g) for g in pgids):
        time.sleep(0.25)
    _signal(pgids, signal.SIGKILL)
    time.sleep(0.5)
    return [pid for g in pgids for pid in _group_members(g)]


def _cluster_nodes(address: str, env: dict[str, str]) -> dict[str, dict[str, float]]:
    """Alive nodes of the cluster, asked from a separate driver (this process must not hold a Ray
    connection when Flower calls ``ray.init``)."""
    code = (
        "import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False);"
        "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))"
    ) % address
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=START_TIMEOUT_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def two_node_cluster(monkeypatch) -> Iterator[Cluster]:
    root = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must stay < 107 chars
    env = dict(os.environ, RAY_TMPDIR=root, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    monkeypatch.setenv("RAY_TMPDIR", root)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    pgids: list[int] = []

    def start(*args: str) -> None:
        proc = subprocess.Popen([RAY, "start", *args], env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        pgids.append(proc.pid)  # a new session: its process group id is its pid
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, out

    try:
        start("--head", f"--port={port}", f"--ray-client-server-port={_free_port()}", "--include-dashboard=false",
              f"--dashboard-port={_free_port()}", *_node_args(root, "head_node"))
        start(f"--address={address}", *_node_args(root, "worker_node"))
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(nodes := _cluster_nodes(address, env)) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        assert len(nodes) == 2, nodes
        head = next(n for n, r in nodes.items() if r.get("head_node") == 1 and r.get("CPU") == 1)
        worker = next(n for n, r in nodes.items() if r.get("worker_node") == 1 and r.get("CPU") == 1)
        yield Cluster(address, nodes, head, worker)
    finally:
        import ray

        if ray.is_initialized():  # a failed run may leave this process attached: detach before the GCS goes
            ray.shutdown()
        survivors = _stop(pgids[::-1])
        shutil.rmtree(root, ignore_errors=True)
        assert not survivors, f"Ray processes left running: {survivors}"


def _recording_node(log: str):
    """A Flower client mod appending the Ray node that runs each message's ClientApp to ``log``.

    A closure, so that cloudpickle ships it to the actors by value (this test module is not
    importable there)."""

    def record_node(msg, context, call_next):
        import ray

        with open(log, "a") as f:
            f.write(f"{ray.get_runtime_context().get_node_id()} {context.node_config['partition-id']} "
                    f"{msg.metadata.message_type} {os.getpid()}\n")
        return call_next(msg, context)

    return record_node


@pytest.mark.parametrize("address", [None, "10.0.0.1:6379", "auto"])
def test_ray_address_is_passed_to_ray_init(monkeypatch, address):
    """Flower's RayBackend calls ``ray.init(**backend_config["init_args"])``: the address goes there,
    and without one nothing is added (Ray's default: RAY_ADDRESS, the last ``ray start``, or a new Ray)."""
    import flwr.simulation

    from fedprivacy.config import RayConfig
    from fedprivacy.engines.ray import run_ray

    seen = {}
    monkeypatch.setattr(flwr.simulation, "run_simulation", lambda **kwargs: seen.update(kwargs))
    run_ray(None, None, 7, RayConfig(num_cpus=2, num_gpus=0.5, address=address))
    assert seen["num_supernodes"] == 7
    assert seen["backend_config"]["client_resources"] == {"num_cpus": 2, "num_gpus": 0.5}
    assert seen["backend_config"]["init_args"].get("address") == address
    assert ("address" in seen["backend_config"]["init_args"]) == (address is not None)


@pytest.mark.ray
@pytest.mark.slow
def test_two_node_ray_cluster_runs_clients_on_both_nodes_and_matches_in_process(
        two_node_cluster, small_config, tmp_path, monkeypatch):
    cluster = two_node_cluster
    log = tmp_path / "nodes.log"
    mod = _recording_node(str(log))
    # round_timeout_s only bounds a stuck run; every reply arrives well within it
    common = ("rounds=3", "privacy.expected_cohort=6", "ray.num_cpus=1", "round_timeout_s=300")
    with monkeypatch.context() as m:  # the in-process reference below runs the plain ClientApp
        m.setattr(run_module, "build_client_app", lambda cfg: build_client_app(cfg, mods=[mod]))
        s_ray = run(small_config(*common, "engine=ray", f"ray.address={cluster.address}",
                                 f"output_dir={tmp_path / 'ray'}"))
    s_in = run(small_config(*common, f"output_dir={tmp_path / 'inprocess'}"))

    # both nodes ran ClientApps (1 CPU per node, 1 per ClientApp: one actor on each node)
    lines = [line.split() for line in log.read_text().splitlines()]
    by_node: dict[str, int] = {}
    for node, _partition, kind, _pid in lines:
        by_node[node] = by_node.get(node, 0) + (kind == "train")
    assert set(by_node) == {cluster.head_id, cluster.worker_id}, (by_node, cluster.nodes)
    assert all(count > 0 for count in by_node.values()), by_node  # training, not only queries, on each

    # the same model and privacy accounting as the in-process engine
    assert s_ray["engine"] == "ray" and s_ray["rounds_completed"] == s_in["rounds_completed"] == 3
    a = torch.load(tmp_path / "inprocess" / "final_model.pt")
    b = torch.load(tmp_path / "ray" / "final_model.pt")
    assert a.keys() == b.keys()
    for name in a:  # replies arrive in another order on Ray: only the float summation order differs
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-5), name
    assert not torch.equal(a["bias"], torch.load(tmp_path / "inprocess" / "initial_model.pt")["bias"])
    assert s_in["epsilon_rdp"] == s_ray["epsilon_rdp"]
    assert s_in["cohort_sampled"] == s_ray["cohort_sampled"]
    assert s_in["cohort_accepted"] == s_ray["cohort_accepted"]
