"""Acceptance tests of ``fedprivacy deploy local``: a real Flower SuperLink and 3 SuperNodes as OS
processes, running the project's ServerApp and ClientApp through ``flwr run``.

Each deployment costs about a minute on a loaded 2-core machine: Flower 1.41 starts a fresh
``flwr-clientapp`` process per message (imports torch and fedprivacy each time) and the ServerApp's
``HttpGrid`` polls replies every 3 s. Two deployments, so the module stays near 2-4 minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from fedprivacy.config import build_config
from fedprivacy.data.synthetic import generate
from fedprivacy.deploy.local import CONNECTION, LocalDeployment, deploy_local, free_ports, processes_using
from fedprivacy.deploy.security import generate_node_keys

pytestmark = pytest.mark.slow

USERS = 3


@pytest.fixture(scope="module")
def three_users(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("so3")
    generate(out, num_clients=USERS, seed=1)
    return out


def _config(data: Path, output_dir: Path, rounds: int):
    return build_config({
        "rounds": rounds, "eval_every": 1, "output_dir": str(output_dir), "seed": 3,
        "data": {"path": str(data), "generate_if_missing": False, "vocab_size": 2000, "num_tags": 50},
        "client": {"epochs": 1, "batch_size": 10, "lr": 5.0},
        # q = 3/3: every user every round, so a dropout is visible in cohort_dropped
        "privacy": {"clip_norm": 1.0, "noise_multiplier": 0.5, "expected_cohort": USERS, "accountants": ["rdp", "pld"]},
    })


def _assert_same_model(a_dir: Path, b_dir: Path) -> None:
    a, b = torch.load(a_dir / "final_model.pt"), torch.load(b_dir / "final_model.pt")
    for name in a:
        # the replies arrive in another order: only the float summation order may differ
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-5), name
    assert not torch.equal(a["bias"], torch.load(a_dir / "initial_model.pt")["bias"])


def _inprocess_with_dropouts(cfg, dropped: dict[int, set[int]]) -> dict:
    """The in-process engine with the same clients failing in the same rounds (round -> partitions)."""
    from flwr.clientapp import ClientApp

    from fedprivacy.engines.inprocess import run_inprocess
    from fedprivacy.fl.client_app import build_client_app
    from fedprivacy.fl.server_app import build_server_app
    from fedprivacy.stackoverflow_tasks import load_task

    inner = build_client_app(cfg)

    class Failing(ClientApp):
        def __call__(self, message, context):
            if message.metadata.message_type == "train":
                t = int(message.content["config"]["server-round"])
                if int(context.node_config["partition-id"]) in dropped.get(t, set()):
                    raise RuntimeError("dropped out")
            return inner(message, context)

    run_inprocess(build_server_app(cfg), Failing(), load_task(cfg.data).population)
    return json.loads((Path(cfg.output_dir) / "summary.json").read_text())


def test_three_supernodes_three_rounds_tls_auth_matches_in_process(three_users, tmp_path):
    """SuperLink + 3 SuperNodes with TLS and SuperNode authentication, 3 DP-FedAvg rounds: metrics,
    resource report, the same model as the in-process engine, no process left; an unregistered
    SuperNode and a plaintext client are refused while the run is live."""
    cfg = _config(three_users, tmp_path / "deployed", rounds=3)
    refused: dict[str, subprocess.CompletedProcess] = {}

    def probe_security(dep: LocalDeployment, row: dict) -> None:
        if row["round"] != "1":
            return
        stranger = generate_node_keys(tmp_path / "stranger", "key")
        base = [dep._exe("flower-supernode"), "--superlink", dep.address, "--max-retries", "0",
                "--node-config", "partition-id=0 num-partitions=3", "--port", str(free_ports(1)[0])]
        log = tmp_path / "stranger.log"
        with open(log, "wb") as f:  # its SuperExec child outlives it: wait for the SuperNode, then end its group
            proc = subprocess.Popen(base + ["--root-certificates", str(dep.tls.ca_cert),
                                            "--auth-supernode-private-key", str(stranger.private_key)],
                                    stdout=f, stderr=subprocess.STDOUT, env=dep.env, start_new_session=True)
        try:
            proc.wait(120)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        refused["unregistered"] = subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")
        refused["tls_cli"] = dep.flwr_cli("supernode", "list", CONNECTION, "--format", "json")  # TLS-verified: works
        cfg_toml = dep.home / "config.toml"
        original = cfg_toml.read_text()
        try:  # the same CLI call without TLS must fail against the TLS SuperLink
            cfg_toml.write_text("\n".join(line for line in original.splitlines() if not line.startswith("root-certificates"))
                                + "\ninsecure = true\n")
            refused["insecure_cli"] = dep.flwr_cli("supernode", "list", CONNECTION, "--format", "json", timeout=60)
        finally:
            cfg_toml.write_text(original)

    lines: list[str] = []
    summary = deploy_local(cfg, USERS, secure=True, reproducible=True, timeout=600, on_round=probe_security,
                           printer=lines.append)
    out = Path(cfg.output_dir)
    workdir = out / "deployment"

    # the run: 3 rounds, nobody dropped, accounting as configured
    assert summary["engine"] == "deployment" and summary["rounds_completed"] == 3
    assert summary["deployment"]["secure"] is True and len(set(summary["deployment"]["node_ids"])) == USERS
    metrics = pd.read_csv(out / "metrics.csv")
    assert list(metrics["round"]) == [1, 2, 3]
    assert (metrics["cohort_sampled"] == USERS).all() and (metrics["cohort_accepted"] == USERS).all()
    assert (metrics["cohort_dropped"] == 0).all()
    assert metrics["epsilon_rdp"].is_monotonic_increasing and metrics["test_accuracy"].notna().all()
    assert sum(line.startswith("round ") for line in lines) == 3  # progress streamed per round

    # security: TLS + auth were on, and enforced
    argv = (workdir / "logs" / "superlink.log").read_text()
    assert "--enable-supernode-auth" in argv and "--ssl-certfile" in argv
    stranger = refused["unregistered"]
    assert stranger.returncode != 0 and "Failed to initialize the connection" in stranger.stdout + stranger.stderr
    def cli_ok(res: subprocess.CompletedProcess) -> bool:  # `flwr --format json` reports failures in the JSON
        return res.returncode == 0 and json.loads(res.stdout[res.stdout.index("{"):]).get("success", False)

    assert cli_ok(refused["tls_cli"]), refused["tls_cli"].stdout + refused["tls_cli"].stderr
    assert not cli_ok(refused["insecure_cli"]), refused["insecure_cli"].stdout

    # resource report: every client, every round
    report = json.loads((out / "resources_summary.json").read_text())
    assert set(report["clients"]) == {"0", "1", "2"}
    model_bytes = 4 * 2000 * 50 + 4 * 50
    for c in report["clients"].values():
        assert c["rounds"] == 3 and c["failed_calls"] == 0
        assert c["peak_rss_mb"] > 50 and c["seconds_per_round_mean"] > 0
        assert model_bytes <= c["bytes_down_per_round"] < model_bytes + 10_000
        assert 0 < c["bytes_up_per_round"] <= 3 * model_bytes
    assert len(pd.read_csv(out / "resources.csv")) >= 3 * USERS

    # same config and seed on the in-process engine: same model, same epsilon
    inproc = build_config({**json.loads(cfg.to_json()), "output_dir": str(tmp_path / "inprocess")})
    s_in = _inprocess_with_dropouts(inproc, {})
    _assert_same_model(tmp_path / "inprocess", out)
    assert s_in["epsilon_rdp"] == summary["epsilon_rdp"] and s_in["epsilon_pld"] == summary["epsilon_pld"]

    # nothing left running
    assert processes_using(workdir / "flwr-home") == []


def test_killed_supernode_is_a_dropout_and_a_restarted_one_rejoins(three_users, tmp_path):
    """SuperNode 1 is stopped after round 1 and restarted after round 2 (secure mode: its registered
    key gives it the same node id again): its rounds count zero with the noise and the divisor unchanged (the model equals the
    in-process engine's with that client failing in those rounds), epsilon is unchanged, the run
    finishes, and the restarted SuperNode trains again under the same node id."""
    cfg = _config(three_users, tmp_path / "deployed", rounds=4)

    def chaos(dep: LocalDeployment, row: dict) -> None:
        if row["round"] == "1":
            dep.kill_supernode(1)  # SIGTERM to its process group: ClientApp, SuperExec and SuperNode
        elif row["round"] == "2":
            dep.restart_supernode(1)

    summary = deploy_local(cfg, USERS, secure=True, reproducible=True, timeout=600, on_round=chaos,
                           printer=lambda _: None)
    out = Path(cfg.output_dir)
    metrics = pd.read_csv(out / "metrics.csv").set_index("round")
    assert summary["rounds_completed"] == 4 and summary["stop_reason"] == "rounds"
    assert metrics.loc[1, "cohort_dropped"] == 0
    assert metrics.loc[2, "cohort_dropped"] == 1 and metrics.loc[2, "cohort_accepted"] == USERS - 1
    assert metrics.loc[4, "cohort_dropped"] == 0, "the restarted SuperNode did not rejoin"
    assert (metrics["cohort_sampled"] == USERS).all()

    # the restarted SuperNode trained again, under its registered node id
    res = pd.read_csv(out / "resources.csv")
    node1 = res[(res["partition"] == 1) & (res["message_type"] == "train") & ~res["failed"]]
    assert {1, 4} <= set(node1["round"]) and 2 not in set(node1["round"])
    assert node1["node_id"].nunique() == 1 and int(node1["node_id"].iloc[0]) == summary["deployment"]["node_ids"][1]
    assert node1["pid"].nunique() == len(node1)  # a fresh ClientApp process per round

    # correct accounting: the same model and epsilon as in-process with client 1 failing in those rounds
    dropped = {int(t): {1} for t, d in metrics["cohort_dropped"].items() if d > 0}
    inproc = build_config({**json.loads(cfg.to_json()), "output_dir": str(tmp_path / "inprocess")})
    s_in = _inprocess_with_dropouts(inproc, dropped)
    _assert_same_model(tmp_path / "inprocess", out)
    assert s_in["epsilon_rdp"] == summary["epsilon_rdp"]
    # in-process the failure is an error reply from the node (received, not accepted); over Flower the
    # SuperLink answers for the offline node from node id 1, which the ServerApp ignores, so the client
    # counts as dropped. Either way it contributes zero and the accepted cohort is the same.
    assert list(pd.read_csv(tmp_path / "inprocess" / "metrics.csv")["cohort_accepted"]) == list(metrics["cohort_accepted"])

    assert processes_using(out / "deployment" / "flwr-home") == []


@pytest.mark.parametrize("client", [
    pytest.param({"privacy": {"placement": "local"}}, id="local-noise"),
    pytest.param({"privacy": {"placement": "distributed"},
                  "client": {"sample_dp": {"optimizer": "adam", "lr": 0.01, "noise_multiplier": 1.0, "clip_norm": 1.0,
                                           "batch_size": 4.0, "epochs": 1.0}}}, id="distributed-shares+sample-dp-adam"),
])
def test_on_device_privacy_modes_match_in_process(three_users, tmp_path, client):
    """On-device DP on real SuperNodes (plaintext: security is the first test's subject): the client
    clips and noises its own upload (local), or adds its share of the noise and trains with
    record-level DP-Adam under Opacus-style accounting (distributed + sample-level DP). Each client's
    own epsilon comes back to the server and every per-client epsilon equals the in-process engine's.
    The model does NOT: on a real SuperNode the client's noise comes from the OS's cryptographic
    source, never from the run seed the server knows (in-process it is seeded, for reproducibility);
    even with the server's own draws seeded (``reproducible``), the released models differ."""
    tree = json.loads(_config(three_users, tmp_path / "deployed", rounds=2).to_json())
    for section, values in client.items():
        tree[section] = {**tree[section], **values}
    cfg = build_config(tree)
    summary = deploy_local(cfg, USERS, secure=False, reproducible=True, timeout=600, printer=lambda _: None)
    out = Path(cfg.output_dir)
    assert summary["rounds_completed"] == 2
    assert (pd.read_csv(out / "metrics.csv")["cohort_accepted"] == USERS).all()

    inproc = build_config({**tree, "output_dir": str(tmp_path / "inprocess")})
    s_in = _inprocess_with_dropouts(inproc, {})
    with pytest.raises(AssertionError):
        _assert_same_model(tmp_path / "inprocess", out)
    assert s_in["epsilon_rdp"] == summary["epsilon_rdp"]
    deployed, local = (pd.read_csv(d / "client_privacy.csv").sort_values("client").reset_index(drop=True)
                       for d in (out, tmp_path / "inprocess"))
    assert len(deployed) == USERS and summary["client_epsilon_clients"] == USERS
    pd.testing.assert_frame_equal(deployed, local)
    assert processes_using(out / "deployment" / "flwr-home") == []


def test_compressed_uploads_and_side_information_stay_on_the_supernodes(three_users, tmp_path):
    """State a SuperNode keeps between rounds (Context.state): each client's 4-bit uplink residual and
    AdaDPS's A (sent once). Nothing is lost across 3 rounds: every reply is accepted without A being
    sent again, each round's residual bytes equal the in-process engine's, and so does the model."""
    tree = json.loads(_config(three_users, tmp_path / "deployed", rounds=3).to_json())
    tree["client"] = {**tree["client"], "compression": {"density": 0.05, "quantization": "4bit", "bucket_size": 4096},
                      "adadps": {"source": "ones"}}
    cfg = build_config(tree)
    summary = deploy_local(cfg, USERS, secure=False, reproducible=True, timeout=600, printer=lambda _: None)
    out = Path(cfg.output_dir)
    assert summary["rounds_completed"] == 3
    deployed = pd.read_csv(out / "metrics.csv")
    assert (deployed["cohort_accepted"] == USERS).all()
    assert deployed["side_information_bytes"].iloc[0] > 0 and (deployed["side_information_bytes"].iloc[1:] == 0).all()
    inproc = build_config({**tree, "output_dir": str(tmp_path / "inprocess")})
    _inprocess_with_dropouts(inproc, {})
    local = pd.read_csv(tmp_path / "inprocess" / "metrics.csv")
    assert deployed["residual_bytes_per_client"].tolist() == local["residual_bytes_per_client"].tolist()
    assert (deployed["residual_bytes_per_client"].iloc[1:] > 0).all()
    _assert_same_model(tmp_path / "inprocess", out)
    assert processes_using(out / "deployment" / "flwr-home") == []
