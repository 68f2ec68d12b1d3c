"""Fast checks of the deployment's pieces (no Flower processes): credentials in the formats Flower
1.41 loads, the population mapping, free ports, the resource mod and report."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedprivacy.config import ConfigError, build_config
from fedprivacy.deploy import resources
from fedprivacy.deploy.local import deployment_config, free_ports, processes_using
from fedprivacy.deploy.security import generate_node_keys, generate_tls


def test_tls_certificate_covers_localhost_and_chains_to_the_ca(tmp_path):
    files = generate_tls(tmp_path)
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    cert.verify_directly_issued_by(ca)
    assert files.server_key.stat().st_mode & 0o077 == 0


def test_node_keys_load_with_flowers_loaders(tmp_path):
    keys = generate_node_keys(tmp_path, "n0")
    private = load_ssh_private_key(keys.private_key.read_bytes(), None)  # flower-supernode's loader
    public = load_ssh_public_key(keys.public_key.read_bytes())  # `flwr supernode register`'s loader
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert public.public_numbers() == private.public_key().public_numbers()
    from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

    assert uses_nist_ec_curve(public)


def test_population_is_the_number_of_supernodes(tmp_path):
    cfg = build_config({"output_dir": "runs/x", "data": {"path": "data/x"}, "privacy": {"expected_cohort": 3}})
    same = deployment_config(cfg, None, population=5)
    assert same.data.max_clients is None and Path(same.output_dir).is_absolute() and Path(same.data.path).is_absolute()
    fewer = deployment_config(cfg, 3, population=5)
    assert fewer.data.max_clients == 3
    with pytest.raises(ConfigError, match="only 5 training users"):
        deployment_config(cfg, 6, population=5)
    with pytest.raises(ConfigError, match="expected_cohort=3 exceeds"):
        deployment_config(cfg, 2, population=5)


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(p > 0 for p in ports)


def test_resource_mod_logs_one_line_per_call_and_never_changes_the_reply(tmp_path):
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1  # as the in-process engine does
    log = tmp_path / "node.jsonl"
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 2, resources.RESOURCE_LOG_KEY: str(log)},
                  state=RecordDict(), run_config={})
    x = ArrayRecord({"w": Array(np.zeros(100, "float32"))})
    msg = Message(RecordDict({"arrays": x, "config": ConfigRecord({"server-round": 4})}), dst_node_id=7,
                  message_type="train")
    sent = RecordDict({"arrays": ArrayRecord({"values": Array(np.ones(10, "float32"))})})

    def app(m, c):
        return Message(sent, reply_to=m)

    reply = resources.resource_mod(msg, ctx, app)
    assert reply.content is sent
    row = json.loads(log.read_text())
    assert (row["partition"], row["round"], row["node_id"], row["message_type"]) == (2, 4, 7, "train")
    assert row["bytes_down"] >= 400 and 40 <= row["bytes_up"] < 400 and row["peak_rss_bytes"] > 0
    summary = resources.collect(tmp_path, tmp_path / "out")
    assert summary["clients"]["2"]["rounds"] == 1
    assert (tmp_path / "out" / resources.RESOURCES_CSV).exists()


def test_processes_using_finds_children_by_flwr_home(tmp_path):
    env = {"FLWR_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        deadline = time.monotonic() + 10
        while child.pid not in processes_using(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in processes_using(tmp_path)
    finally:
        child.kill()
        child.wait()
    assert child.pid not in processes_using(tmp_path)


def test_the_client_app_imports_no_server_side_or_record_level_dp_modules():
    """Under Flower's deployment runtime every message starts a fresh ClientApp process: a plain client
    must not pay for dp-accounting, Opacus or the ServerApp's modules (about 2.5 s of imports here)."""
    import subprocess
    import sys

    code = ("import sys, fedprivacy.deploy.apps; "
            "print(sorted(m for m in ('opacus', 'dp_accounting', 'fedprivacy.fl.server_app', 'matplotlib') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("overrides", "secure_aggregation", "floor"), [
    ((), False, ""),
    (("privacy.placement=local",), False, "noise-multiplier-floor=0.5"),
    (("privacy.placement=distributed",), False, "noise-multiplier-floor=0.5 expected-cohort-ceiling=8"),
    ((), True, "noise-multiplier-floor=0.5 expected-cohort-ceiling=8 bits-floor=20 secagg-threshold=5 "
               "secagg-neighbours=7"),
], ids=["central", "local", "distributed", "secure-aggregation"])
def test_deploy_local_gives_each_supernode_the_runs_noise_floor_in_its_node_config(small_config, monkeypatch, tmp_path,
                                                                                    overrides, secure_aggregation,
                                                                                    floor):
    """A deployed client refuses client-side noise settings below its node config's floor (fl/noise_floor.py):
    ``fedprivacy deploy local`` sets that floor to the run's own settings, so its clients train."""
    import yaml
    from flwr.common.config import parse_config_args

    from fedprivacy.deploy import local
    from fedprivacy.fl.noise_floor import NoiseFloor, enforce

    made = {}
    real = local.LocalDeployment

    class Stop(Exception):
        """Stops deploy_local once it has built its deployment's arguments."""

    def record(*args, **kwargs):
        made.update(kwargs)
        raise Stop

    monkeypatch.setattr(local, "LocalDeployment", record)
    cfg = small_config(*overrides)
    with pytest.raises(Stop):
        local.deploy_local(cfg, 8, secure=False, secure_aggregation=secure_aggregation, printer=lambda _: None)
    line = real(tmp_path, 8, secure=False, extra_node_config=made["extra_node_config"])._node_config(3)
    assert line.startswith("partition-id=3 num-partitions=8 ") and line.endswith(floor) and ("floor" in line) == bool(floor)
    deployed = build_config(yaml.safe_load((tmp_path / "run" / "deployment" / "config.yaml").read_text()))
    enforce(NoiseFloor.from_node_config(parse_config_args([line])), deployed.privacy)  # the node trains at the run's noise
    if secure_aggregation:  # t and k from its own node config; with TLS, its auth key signs and the roster is all nodes'
        from fedprivacy.deploy.security import generate_node_keys
        from fedprivacy.fl.noise_floor import SecAggNode
        from flwr.supercore.primitives.asymmetric import bytes_to_private_key, public_key_to_bytes

        sa = deployed.privacy.secure_aggregation
        assert SecAggNode.from_node_config(parse_config_args([line])) == SecAggNode(sa.threshold, sa.neighbours)
        secure = real(tmp_path, 8, secure=True, extra_node_config=made["extra_node_config"])
        secure.keys = [generate_node_keys(tmp_path / "keys", f"supernode-{i}") for i in range(8)]
        secure._write_roster()
        node = SecAggNode.from_node_config(parse_config_args([secure._node_config(3)]))
        own = public_key_to_bytes(bytes_to_private_key(node.identity_key).public_key())
        assert node.roster is not None and len(node.roster) == 8 and own in node.roster
