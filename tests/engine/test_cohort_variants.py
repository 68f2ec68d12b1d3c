"""The study's client variants trained together (multi-label tags, AdaDPS's preconditioner, DiSK's two
passes, the uplink compression's residual): the same replies, node states and models as the
ClientApp one client at a time, within float rounding; ``cohort_batching: on`` accepts them."""

import pandas as pd
import pytest
import torch

from fedprivacy.client.sparse_cohort import train_sparse_cohort
from fedprivacy.config import ConfigError
from fedprivacy.engines import cohorts
from fedprivacy.engines.cohorts import cohort_trainer
from fedprivacy.fl.side_information import RECORD
from fedprivacy.run import run

VARIANTS = {
    "multilabel": ("data.task=tag_multilabel", "client.lr=50.0"),
    "adadps": ("client.adadps={source: top_words, top_words: 100, multiplier: 200}",),
    "multilabel-adadps": ("data.task=tag_multilabel", "client.lr=50.0",
                          "client.adadps={source: top_words, top_words: 100, multiplier: 200}"),
    "disk": ("server.disk={kappa: 0.7, gamma: 0.5}",),
    "disk-lookahead-only": ("server.disk={kappa: 0.5, gamma: 1.0}",),  # c = 1: one pass from the lookahead
    "multilabel-disk-adadps": ("data.task=tag_multilabel", "client.lr=50.0", "server.disk={kappa: 0.7, gamma: 0.5}",
                               "client.adadps={source: top_words, top_words: 100, multiplier: 200}"),
}
"""(The uplink compression's top-k and rounding turn float rounding into different coordinates: its replies
and residuals are compared bit for bit, on the same training, in test_one_client_path.py.)"""


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_run_trained_together_equals_the_client_app_one_at_a_time(small_config, tmp_path, monkeypatch, variant):
    trained = []

    def counting(model, clients, **kw):
        trained.append((len(clients), kw["start_from"] is not None, kw["preconditioner"] is not None))
        return train_sparse_cohort(model, clients, **kw)

    monkeypatch.setattr(cohorts, "train_sparse_cohort", counting)
    monkeypatch.setattr(cohorts, "SPARSE_CHUNK_EXAMPLES", 100)  # several chunks per round
    out = {}
    for mode in ("on", "off"):
        cfg = small_config(*VARIANTS[variant], f"cohort_batching={mode}", f"output_dir={tmp_path / mode}", "rounds=3",
                           "checkpoint_every=1")
        assert (cohort_trainer(cfg) is None) == (mode == "off")
        out[mode] = run(cfg)
    sampled = pd.read_csv(tmp_path / "on" / "metrics.csv")["cohort_sampled"].astype(int)
    passes = 1 + (variant in ("disk", "multilabel-disk-adadps"))
    assert sum(n for n, _, _ in trained) == sampled.sum() + (passes - 1) * sampled[1:].sum()  # DiSK: 2 from round 2
    assert any(ahead for _, ahead, _ in trained) == ("disk" in variant)
    assert all(pre == ("adadps" in variant) for _, _, pre in trained)
    final = {mode: torch.load(tmp_path / mode / "final_model.pt") for mode in out}
    initial = torch.load(tmp_path / "off" / "initial_model.pt")
    for name in final["off"]:
        torch.testing.assert_close(final["on"][name], final["off"][name], rtol=1e-5, atol=1e-6)
        assert not torch.equal(final["off"][name], initial[name])
    states = {mode: torch.load(tmp_path / mode / "checkpoint.pt", weights_only=False)["node_states"] for mode in out}
    assert states["on"].keys() == states["off"].keys()
    assert bool(states["on"]) == ("adadps" in variant)
    for node, state in states["off"].items():  # AdaDPS's A sent once and kept; the residual carried over
        assert set(state.keys()) == set(states["on"][node].keys())
        for key in state.array_records:
            for name, array in state[key].items():
                torch.testing.assert_close(torch.from_numpy(states["on"][node][key][name].numpy()),
                                           torch.from_numpy(array.numpy()), rtol=1e-5, atol=1e-6)
    assert ("adadps" in variant) == any(RECORD in s for s in states["on"].values())
    assert out["on"]["epsilon_rdp"] == out["off"]["epsilon_rdp"]


@pytest.mark.parametrize("overrides", [("client.compression={density: 0.02}",),
                                       ("client.adadps={source: top_words, top_words: 100, multiplier: 200}",),
                                       ("server.disk={kappa: 0.7, gamma: 0.5}",)])
def test_cohort_batching_on_accepts_the_study_s_client_variants(small_config, overrides):
    assert cohort_trainer(small_config(*overrides, "cohort_batching=on", "data.task=tag_multilabel")) is not None


def test_cohort_batching_on_still_refuses_record_level_dp(small_config):
    with pytest.raises(ConfigError, match="client.sample_dp"):
        cohort_trainer(small_config("client.sample_dp={noise_multiplier: 1.0}", "cohort_batching=on"))


def test_a_cohort_whose_messages_disagree_on_disk_inputs_is_refused(small_config):
    """One lookahead and one ``disk-c`` per cohort: otherwise (or without ``disk-c``) the grid trains them one at
    a time."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedprivacy.engines.cohorts import CohortTrainer
    from fedprivacy.fl.records import model_to_record
    from fedprivacy.stackoverflow_tasks import load_task

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1  # Flower's Message needs them
    cfg = small_config()
    task = load_task(cfg.data)
    trainer = CohortTrainer(cfg, task, task.new_model())
    record, ahead = model_to_record(task.new_model()), model_to_record(task.new_model())

    def message(node, **config):
        return Message(RecordDict({"arrays": record, "lookahead": ahead,
                                   "config": ConfigRecord({"server-round": 2, "clip-norm": 1.0, **config})}),
                       dst_node_id=node, message_type="train")

    assert trainer.handles([message(2, **{"disk-c": 0.5})])
    for batch, match in (([message(2, **{"disk-c": 0.5}), message(3, **{"disk-c": 0.4})], "different"),
                         ([message(2)], "without its 'disk-c'")):
        with pytest.raises(ValueError, match=match):
            list(trainer.replies(batch, [RecordDict() for _ in batch]))
