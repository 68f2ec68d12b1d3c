"""DP-FedAvg end to end through the Flower apps on the in-process engine.

Covers the issue's acceptance properties and ARCHITECTURE invariants 1-5, 8, 11, 12 at the
level a user meets them: the model files a run writes.
"""

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord
from torch.nn.utils import parameters_to_vector

from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.population import discover_nodes
from fedprivacy.fl.server_app import build_server_app
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.outputs import RunExistsError
from fedprivacy.privacy.accounting import PrivacyLedger, epsilon
from fedprivacy.privacy.sampling import make_sampler
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task


def _flat(path) -> torch.Tensor:
    state = torch.load(path)
    task_model_order = ["bias", "embedding.weight"]  # named_parameters() order
    return torch.cat([state[k].reshape(-1) for k in task_model_order])


def _model_change(cfg) -> torch.Tensor:
    return _flat(cfg.output_dir / "final_model.pt") - _flat(cfg.output_dir / "initial_model.pt")


def _run_with_mods(cfg, mods):
    population = load_task(cfg.data).population
    run_inprocess(build_server_app(cfg), build_client_app(cfg, mods=mods), population)


def test_no_noise_and_huge_clip_is_plain_unweighted_fedavg(small_config):
    cfg = small_config("rounds=1", "privacy.noise_multiplier=0", "privacy.clip_norm=1e9",
                       "privacy.sampling=fixed", "privacy.accountants=[rdp]")
    run(cfg)
    task = load_task(cfg.data)
    cohort = make_sampler("fixed", task.population, 8, cfg.seed).sample()
    model = task.new_model()
    deltas = [local_sgd(model, *task.client_data(int(i)), epochs=1, batch_size=10, lr=5.0,
                        rng=client_generator(cfg.seed, 1, int(i))).update.to_dense() for i in cohort]
    expected = torch.stack(deltas).mean(0)  # unweighted mean over the cohort
    assert expected.abs().max() > 0
    assert torch.allclose(_model_change(cfg), expected, atol=1e-6)


def test_one_round_with_zero_client_lr_moves_the_model_by_noise_of_std_zC_over_m(small_config):
    z, clip, m = 2.0, 0.5, 8
    cfg = small_config("rounds=1", "client.lr=0", f"privacy.noise_multiplier={z}", f"privacy.clip_norm={clip}",
                       f"privacy.expected_cohort={m}")
    summary = run(cfg)
    change = _model_change(cfg)
    assert change.numel() == 100_050
    # 100,050 i.i.d. draws: the std estimate's relative s.e. is 1/sqrt(2d) ~ 0.22%
    assert float(change.std()) == pytest.approx(z * clip / m, rel=0.01)
    assert abs(float(change.mean())) < 5 * z * clip / m / np.sqrt(change.numel())
    assert summary["cohort_accepted"] == summary["cohort_sampled"]  # zero updates still count


def _corrupt(kind: str, partitions: set[int]):
    def mod(msg, context, call_next):
        partition = int(context.node_config["partition-id"])
        if msg.metadata.message_type != "train":
            return call_next(msg, context)
        if partition in partitions and kind == "raise":
            raise RuntimeError("device crashed")
        reply = call_next(msg, context)
        if partition in partitions:
            values = reply.content["arrays"]["values"].numpy()
            fill = {"nan": np.nan, "inf": np.inf, "zero": 0.0}[kind]
            reply.content["arrays"] = ArrayRecord({"indices": reply.content["arrays"]["indices"],
                                                   "values": Array(np.full_like(values, fill))})
        return reply

    return mod


def test_failed_nan_and_inf_clients_contribute_zero_without_changing_noise(small_config, tmp_path):
    # which clients are in round 1's cohort is fixed by the seed: corrupt two of them
    cfg0 = small_config("rounds=2")
    population = load_task(cfg0.data).population
    bad = set(make_sampler("poisson", population, 8, cfg0.seed).sample()[:2].tolist())
    assert bad
    finals = {}
    for kind in ("zero", "nan", "inf", "raise"):
        cfg = small_config("rounds=2", f"output_dir={tmp_path / kind}")
        _run_with_mods(cfg, [_corrupt(kind, bad)])
        finals[kind] = _flat(cfg.output_dir / "final_model.pt")
        rows = json.loads((cfg.output_dir / "summary.json").read_text())
        assert rows["rounds_completed"] == 2
    for kind in ("nan", "inf", "raise"):
        assert torch.equal(finals[kind], finals["zero"]), kind  # same noise, same divisor, zero contribution
    honest = small_config("rounds=2", f"output_dir={tmp_path / 'honest'}")
    run(honest)
    assert not torch.equal(_flat(honest.output_dir / "final_model.pt"), finals["zero"])


def test_metrics_report_rejections_and_dropouts(small_config, tmp_path):
    cfg = small_config("rounds=1")
    population = load_task(cfg.data).population
    cohort = make_sampler("poisson", population, 8, cfg.seed).sample().tolist()
    _run_with_mods(cfg, [_corrupt("nan", {cohort[0]}), _corrupt("raise", {cohort[1]})])
    import pandas as pd

    row = pd.read_csv(cfg.output_dir / "metrics.csv").iloc[0]
    assert row["rejected_nonfinite"] == 1
    assert row["cohort_received"] == len(cohort)
    assert row["cohort_accepted"] == len(cohort) - 2


def test_budget_stops_before_the_round_that_would_exceed_it(small_config):
    probe = small_config("rounds=6")
    run(probe)
    eps = json.loads((probe.output_dir / "summary.json").read_text())
    import pandas as pd

    per_round = pd.read_csv(probe.output_dir / "metrics.csv")["epsilon_rdp"].tolist()
    target = (per_round[2] + per_round[3]) / 2  # between round 3 and round 4
    cfg = small_config("rounds=6", f"privacy.target_epsilon={target}", f"output_dir={probe.output_dir}_budget")
    summary = run(cfg)
    assert summary["stop_reason"] == "privacy_budget"
    assert summary["rounds_completed"] == 3
    assert summary["epsilon_rdp"] <= target < per_round[3]
    assert eps["rounds_completed"] == 6


def test_resume_continues_bit_exactly_and_keeps_the_accountant(small_config, tmp_path):
    full = small_config("rounds=4", f"output_dir={tmp_path / 'full'}")
    run(full)
    part = small_config("rounds=2", f"output_dir={tmp_path / 'part'}")
    run(part)
    with pytest.raises(RunExistsError):
        run(part)  # never silently overwrites a run
    resumed = small_config("rounds=4", f"output_dir={tmp_path / 'part'}")
    summary = run(resumed, resume=True)
    assert torch.equal(_flat(tmp_path / "part" / "final_model.pt"), _flat(tmp_path / "full" / "final_model.pt"))
    ledger = PrivacyLedger.from_state_dict(torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)["ledger"])
    assert ledger.rounds == 4  # the 2 rounds before the restart are still accounted
    full_summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["epsilon_rdp"] == full_summary["epsilon_rdp"]
    assert summary["epsilon_rdp"] == pytest.approx(epsilon(ledger, summary["delta"], "rdp"))


def test_a_crash_after_a_mid_run_checkpoint_resumes_bit_exactly(small_config, tmp_path, monkeypatch):
    # round 2's checkpoint is written while round 3's noise is already being drawn (prefetched)
    full = small_config("rounds=4", f"output_dir={tmp_path / 'full'}")
    run(full)
    part = small_config("rounds=4", "checkpoint_every=2", f"output_dir={tmp_path / 'part'}")
    original = DPFedAvg._round

    def crash_in_round_3(self, *args):
        if self.round == 2:
            raise RuntimeError("simulated crash")
        return original(self, *args)

    monkeypatch.setattr(DPFedAvg, "_round", crash_in_round_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(part)
    monkeypatch.undo()
    run(part, resume=True)
    assert torch.equal(_flat(tmp_path / "part" / "final_model.pt"), _flat(tmp_path / "full" / "final_model.pt"))


def test_ledger_records_the_event_matching_the_sampler(small_config, tmp_path):
    for sampling, accountants in (("poisson", "[rdp,pld]"), ("fixed", "[rdp]")):
        cfg = small_config("rounds=1", f"privacy.sampling={sampling}", f"privacy.accountants={accountants}",
                           f"output_dir={tmp_path / sampling}")
        summary = run(cfg)
        state = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=False)
        (entry,) = PrivacyLedger.from_state_dict(state["ledger"]).entries
        rnd = entry[0]
        assert rnd.sampling == sampling
        assert rnd.population == summary["population"] == 40  # the FULL population
        assert rnd.expected_cohort == 8
        assert summary["delta"] == pytest.approx(1 / 40)


def test_run_folder_holds_every_output(small_config):
    cfg = small_config()
    run(cfg)
    names = {p.name for p in cfg.output_dir.iterdir()}
    assert {"config.yaml", "metrics.csv", "initial_model.pt", "final_model.pt", "checkpoint.pt",
            "metrics.png", "summary.json"} <= names
    import pandas as pd

    df = pd.read_csv(cfg.output_dir / "metrics.csv")
    assert list(df["round"]) == [1, 2]
    assert {"train_loss", "test_accuracy", "epsilon_rdp", "epsilon_pld", "seconds"} <= set(df.columns)
    assert (df["epsilon_rdp"].diff().dropna() > 0).all()


class _SlowRegistrationGrid:
    """Nodes appear over time, as on a real SuperLink."""

    def __init__(self, inner, visible_after):
        self.inner, self.calls, self.visible_after = inner, 0, visible_after

    def get_node_ids(self):
        self.calls += 1
        ids = list(self.inner.get_node_ids())
        return ids if self.calls >= self.visible_after else ids[: len(ids) // 3]

    def send_and_receive(self, messages, timeout=None):
        return self.inner.send_and_receive(messages, timeout=timeout)


def test_node_discovery_waits_for_the_full_population(small_config):
    from fedprivacy.engines.inprocess import InProcessGrid

    cfg = small_config()
    grid = _SlowRegistrationGrid(InProcessGrid(build_client_app(cfg), 40), visible_after=4)
    nodes = discover_nodes(grid, 40, timeout=5)
    assert grid.calls >= 4 and len(set(nodes)) == 40
    with pytest.raises(TimeoutError):
        discover_nodes(_SlowRegistrationGrid(InProcessGrid(build_client_app(cfg), 40), visible_after=10**9), 40,
                       timeout=0.2)


def test_model_parameters_are_flattened_in_named_parameter_order(small_config):
    model = load_task(small_config().data).new_model()
    names = [n for n, _ in model.named_parameters()]
    assert names == ["bias", "embedding.weight"]
    assert parameters_to_vector(model.parameters()).numel() == 100_050


def test_server_momentum_state_is_built_from_the_noised_release_only(small_config):
    # clients send zero deltas, so everything the optimizer sees is the mechanism's noise:
    # its velocity after round 1 must equal the released g = noise / m, and the model moved by lr * g
    z, clip, m, lr = 1.5, 2.0, 8, 0.7
    cfg = small_config("rounds=1", "client.lr=0", f"privacy.noise_multiplier={z}", f"privacy.clip_norm={clip}",
                       f"privacy.expected_cohort={m}", "server.momentum=0.9", f"server.lr={lr}")
    run(cfg)
    velocity = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=False)["optimizer"]["velocity"]
    assert float(velocity.std()) == pytest.approx(z * clip / m, rel=0.01)
    assert torch.allclose(_model_change(cfg), lr * velocity, atol=1e-7)


def test_in_process_grid_push_then_pull_delivers_like_send_and_receive(small_config):
    from fedprivacy.engines.inprocess import InProcessGrid
    from fedprivacy.fl.population import identity_query

    grid = InProcessGrid(build_client_app(small_config()), 5)
    queries = [identity_query(n) for n in grid.get_node_ids()]
    ids = list(grid.push_messages(queries))
    replies = list(grid.pull_messages(ids))
    assert sorted(int(r.content["node"]["partition-id"]) for r in replies) == [0, 1, 2, 3, 4]
    assert all(r.metadata.reply_to_message_id in ids for r in replies)
    assert list(grid.pull_messages(ids)) == []  # each message is delivered once


def _malformed(kind: str, partitions: set[int] | None):
    """A mod that replaces the replies of ``partitions`` (None: every client) with a crafted one."""
    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        partition = int(context.node_config["partition-id"])
        if msg.metadata.message_type != "train" or (partitions is not None and partition not in partitions):
            return reply
        arrays = reply.content["arrays"]
        idx, values = arrays["indices"].numpy(), arrays["values"].numpy()
        if kind == "no_train_loss":
            reply.content["metrics"] = MetricRecord({"num-examples": 3})
            return reply
        payload = {"int64": values.astype(np.int64), "bool": values != 0, "big_endian": values.astype(">f4"),
                   "float64_sparse": values.astype(np.float64)}[kind]
        lie = Array(payload)
        lie = Array(dtype="float32", shape=lie.shape, stype=lie.stype, data=lie.data)  # metadata says float32
        reply.content["arrays"] = ArrayRecord({"indices": Array(idx), "values": lie})
        return reply

    return mod


@pytest.mark.parametrize("kind", ["int64", "bool", "big_endian", "float64_sparse"])
def test_replies_of_the_wrong_dtype_count_as_zero_by_reason_and_never_crash(small_config, tmp_path, kind, caplog):
    cfg0 = small_config("rounds=2")
    bad = set(make_sampler("poisson", load_task(cfg0.data).population, 8, cfg0.seed).sample()[:2].tolist())
    cfg = small_config("rounds=2", f"output_dir={tmp_path / kind}")
    with caplog.at_level("WARNING"):
        _run_with_mods(cfg, [_malformed(kind, bad)])
    import pandas as pd

    rows = pd.read_csv(cfg.output_dir / "metrics.csv")
    assert rows.loc[0, "rejected_dtype"] == len(bad) and rows.loc[0, "cohort_accepted"] == rows.loc[0, "cohort_received"] - len(bad)
    warnings = [r.getMessage() for r in caplog.records if "rejected as zero (dtype)" in r.getMessage()]
    assert warnings and warnings[0].startswith("round 1: 2 update(s)")  # one line per reason and round
    zero = small_config("rounds=2", f"output_dir={tmp_path / 'zero'}")
    _run_with_mods(zero, [_corrupt("zero", bad)])
    assert torch.equal(_flat(cfg.output_dir / "final_model.pt"), _flat(zero.output_dir / "final_model.pt"))


def test_a_reply_without_train_loss_still_counts(small_config):
    cfg = small_config("rounds=1")
    _run_with_mods(cfg, [_malformed("no_train_loss", None)])
    summary = json.loads((cfg.output_dir / "summary.json").read_text())
    assert summary["cohort_accepted"] == summary["cohort_sampled"] > 0
    assert summary["rounds_with_no_accepted_update"] == []


def test_a_round_where_every_reply_is_rejected_is_an_error_and_flagged(small_config, caplog):
    cfg = small_config("rounds=2")
    with caplog.at_level("ERROR"):
        _run_with_mods(cfg, [_malformed("bool", None)])
    summary = json.loads((cfg.output_dir / "summary.json").read_text())
    assert summary["rounds_with_no_accepted_update"] == [1, 2]
    assert any("none of the" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


def test_a_crash_after_uncheckpointed_releases_keeps_every_release_accounted_with_fresh_draws(small_config, tmp_path,
                                                                                          monkeypatch):
    """Crash in round 3 of a run that checkpoints every 2 rounds: releases 3 (and its draw) happened
    but the checkpoint holds rounds 1-2. The resume accounts release 3, re-runs round 3 with a new draw
    and cohort (epoch 1), and the ledger counts 5 releases for 4 rounds."""
    from fedprivacy.privacy.release_log import ReleaseLog

    class Crash(Exception):
        pass

    cfg = small_config("rounds=4", "checkpoint_every=2", f"output_dir={tmp_path / 'run'}")
    original = DPFedAvg.post_process

    def crash_after_round_3(self, g, phi):
        original(self, g, phi)
        if self.round == 3:
            raise Crash
    monkeypatch.setattr(DPFedAvg, "post_process", crash_after_round_3)
    with pytest.raises(Crash):
        run(cfg)
    monkeypatch.undo()
    log = ReleaseLog(cfg.output_dir)
    assert [e["round"] for e in log.entries] == [1, 2, 3]
    summary = run(cfg, resume=True)
    log = ReleaseLog(cfg.output_dir)
    assert [e["round"] for e in log.entries] == [1, 2, 3, 3, 4] and [e["epoch"] for e in log.entries] == [0, 0, 0, 1, 1]
    draws = [e["draw"] for e in log.entries]
    assert len(set(draws)) == len(draws)  # no two releases share a draw
    assert summary["releases"] == 5 and summary["rounds_completed"] == 4
    expected = epsilon(PrivacyLedger().compose(log.lost_since(PrivacyLedger())[0], 5), summary["delta"], "rdp")
    assert summary["epsilon_rdp"] == pytest.approx(expected, rel=1e-12)
    # an uninterrupted run accounts 4 releases: the crash cost one round of budget, nothing was lost
    clean = small_config("rounds=4", f"output_dir={tmp_path / 'clean'}")
    assert run(clean)["epsilon_rdp"] < summary["epsilon_rdp"]


def test_a_reused_draw_is_refused(tmp_path):
    from fedprivacy.privacy.accounting import GaussianRound
    from fedprivacy.privacy.release_log import ReleaseLog

    log, ledger = ReleaseLog(tmp_path), PrivacyLedger()
    event = GaussianRound(1.0, "poisson", 10, 2.0)
    log.record(ledger, 1, event, "abc")
    ledger.compose(event)
    with pytest.raises(RuntimeError, match="already used"):
        log.record(ledger, 2, event, "abc")
    (tmp_path / "releases.jsonl").write_text((tmp_path / "releases.jsonl").read_text() + '{"release": 2, "rou')
    assert len(ReleaseLog(tmp_path).entries) == 1  # a line cut by a crash during its own write: not released
    (tmp_path / "releases.jsonl").write_text('garbage\n{"release": 1}\n')
    with pytest.raises(ValueError, match="releases.jsonl: line 1"):
        ReleaseLog(tmp_path)


def test_the_claim_says_whether_the_draws_are_reproducible_and_secure_noise_hides_the_cohort(small_config, tmp_path):
    seeded = run(small_config("rounds=1", f"output_dir={tmp_path / 'seeded'}"))
    assert "reproducible from seed" in seeded["privacy_claim"]
    finals = []
    for name in ("a", "b"):
        cfg = small_config("rounds=1", "privacy.secure_noise=true", f"output_dir={tmp_path / name}")
        summary = run(cfg)
        assert "cryptographic source" in summary["privacy_claim"] and "reproducible" not in summary["privacy_claim"]
        checkpoint = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=False)
        assert checkpoint["sampler"] is None and checkpoint["noise"] is None  # nothing on disk rebuilds a draw
        finals.append(_flat(cfg.output_dir / "final_model.pt"))
    assert not torch.equal(*finals)  # the noise (and cohort) is not a function of the seed


def test_summary_is_strict_json_and_records_the_data_it_used(small_config):
    cfg = small_config("rounds=1", "privacy.noise_multiplier=0")
    run(cfg)

    def refuse(name):
        raise AssertionError(f"summary.json holds the non-JSON constant {name}")
    summary = json.loads((cfg.output_dir / "summary.json").read_text(), parse_constant=refuse)
    assert summary["epsilon_rdp"] == "inf"  # no noise: no privacy, said in valid JSON
    data = summary["data"]
    assert data["synthetic"] is True and data["path"] == str(cfg.data.path.resolve())
    assert {"stackoverflow.sqlite"} <= set(data["files"]) and all(f["size"] > 0 for f in data["files"].values())


def test_a_delta_of_at_least_one_over_n_is_flagged_in_the_claim_and_the_log(small_config, tmp_path, caplog):
    """Hardening II, finding 3: privacy.delta=0.5 ran silently and the default 1/N was never flagged."""
    with caplog.at_level("WARNING"):
        weak = run(small_config("rounds=1", "privacy.delta=0.5", f"output_dir={tmp_path / 'weak'}"))
    assert "delta=0.5 >= 1/population: permits publishing a random user's data in full" in weak["privacy_claim"]
    assert any("delta=0.5 >= 1/population" in r.getMessage() for r in caplog.records)
    default = run(small_config("rounds=1", f"output_dir={tmp_path / 'default'}"))
    assert ">= 1/population" in default["privacy_claim"]  # the default 1/N is exactly such a delta
    strong = run(small_config("rounds=1", "privacy.delta=1e-6", f"output_dir={tmp_path / 'strong'}"))
    assert ">= 1/population" not in strong["privacy_claim"]
