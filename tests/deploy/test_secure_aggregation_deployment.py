"""``fedprivacy deploy local --secure-aggregation`` on a real SuperLink and five SuperNodes with TLS and node
authentication (issue "Secure aggregation", items 3 and 4): one SuperNode killed in the middle of a round (after it
shared its keys), the round completes with the survivors and is accounted with their noise, exactly as
``fedprivacy epsilon`` computes it; a second one killed in the next round leaves fewer uploads than the threshold:
that round and the next (three nodes left) fail cleanly, nothing is released or accounted, and the run goes on to
its last round.

About 5 minutes on a loaded 2-core machine: a SecAgg+ round is four exchanges, each a fresh ``flwr-clientapp``
process per SuperNode and the ServerApp's 3 s polling.
"""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import pandas as pd
import pytest

from fedprivacy.cli import main as cli
from fedprivacy.config import build_config
from fedprivacy.data.synthetic import generate
from fedprivacy.deploy.local import LocalDeployment, deploy_local, processes_using
from fedprivacy.privacy.release_log import ReleaseLog

pytestmark = pytest.mark.slow

USERS, THRESHOLD, NEIGHBOURS, BITS, Z = 5, 4, 5, 20, 0.5


def _kill_after_share_keys(dep: LocalDeployment, index: int, rnd: int) -> threading.Thread:
    """Kill SuperNode ``index`` (SIGKILL) as soon as it has answered round ``rnd``'s share-keys stage."""
    log = dep.resource_dir / f"supernode-{index}.jsonl"

    def watch() -> None:
        deadline = time.time() + 600
        while time.time() < deadline:
            rows = [json.loads(line) for line in (log.read_text().splitlines() if log.exists() else [])
                    if line.strip()]
            if any(r.get("round") == rnd and r.get("stage") == "share-keys" for r in rows):
                dep.kill_supernode(index, signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_supernode_killed_mid_round_leaves_a_round_accounted_with_the_survivors_noise(tmp_path):
    data = tmp_path / "so5"
    generate(data, num_clients=USERS, seed=1)
    cfg = build_config({
        "rounds": 4, "eval_every": 1, "output_dir": str(tmp_path / "deployed"), "seed": 3,
        "data": {"path": str(data), "generate_if_missing": False, "vocab_size": 2000, "num_tags": 50},
        "client": {"epochs": 1, "batch_size": 10, "lr": 5.0},
        "privacy": {"clip_norm": 1.0, "noise_multiplier": Z, "expected_cohort": USERS, "placement": "distributed",
                    "secure_aggregation": {"threshold": THRESHOLD, "neighbours": NEIGHBOURS, "bits": BITS}},
    })
    watchers = []

    def chaos(dep: LocalDeployment, row: dict) -> None:
        if row["round"] == "1":  # round 2: SuperNode 4 dies after sharing its keys, before uploading
            watchers.append(_kill_after_share_keys(dep, 4, 2))
        elif row["round"] == "2":  # round 3: SuperNode 3 too: 3 uploads, below the threshold of 4
            watchers.append(_kill_after_share_keys(dep, 3, 3))

    summary = deploy_local(cfg, USERS, secure=True, secure_aggregation=True, timeout=1200, on_round=chaos,
                           printer=lambda _: None)
    out = Path(cfg.output_dir)
    metrics = pd.read_csv(out / "metrics.csv").set_index("round")
    assert summary["rounds_completed"] == 4 and summary["stop_reason"] == "rounds"
    # round 3 fails after the uploads, round 4 at setup (3 nodes left): nothing released or accounted, the run goes on
    assert list(metrics["secagg_aborted"]) == [0, 0, 1, 1]
    # round 3: 3 uploads if SuperNode 3's share-keys reply left before the kill, else it aborted at share-keys (0)
    assert list(metrics["secagg_survivors"])[:2] == [5, 4] and metrics.loc[3, "secagg_survivors"] in (0, 3)
    assert metrics.loc[4, "secagg_survivors"] == 0
    assert summary["releases"] == 2
    assert metrics.loc[4, "epsilon_rdp"] == metrics.loc[2, "epsilon_rdp"]
    assert summary["deployment"]["secure"] is True and "SecAgg+" in summary["privacy_claim"]
    assert "masked" in summary["privacy_claim"] and "cannot see any single update" in summary["privacy_claim"]

    # every logged release is a Skellam round with its survivors' noise, and fedprivacy epsilon agrees exactly
    events = [entry["event"] for entry in ReleaseLog(out).entries]
    share = events[0].variance / USERS
    assert [round(e.variance / share) for e in events] == [5, 4]
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert cli(["epsilon", "--sampling", "poisson", "--q", "1", "--noise-multiplier", str(Z), "--steps", "2",
                    "--delta", str(summary["delta"]), "--accountant", "rdp", "--skellam-dim", "100050", "--bits",
                    str(BITS), "--clip-norm", "1.0", "--expected-cohort", str(USERS), "--survivors", "5,4"]) == 0
    assert json.loads(buffer.getvalue())["epsilon"]["rdp"] == pytest.approx(summary["epsilon_rdp"], rel=1e-12)

    # what the SuperNodes did: the killed one never uploaded in round 2; each upload is the masked vector only
    res = pd.read_csv(out / "resources.csv")
    collect = res[res["stage"] == "collect"]
    assert 2 not in set(collect[collect["partition"] == 4]["round"])
    assert (collect["bytes_up"] < BITS * 131072 / 8 + 1024).all()  # D = 2^17 values of b bits plus the framing
    assert processes_using(out / "deployment" / "flwr-home") == []
