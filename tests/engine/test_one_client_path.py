"""One client path (issue 30, item 4): the cohort engine replies with the ClientApp's own reply code
(fl/client_app.client_reply, built on fl/mods' uploads), so for the same message and the same local
training both send the same bytes under every placement and with compression; one residual key in
the node state, and a checkpoint that kept the residual under the ClientApp's former key resumes."""

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedprivacy.client.trainer import LocalResult
from fedprivacy.engines import cohorts
from fedprivacy.engines.cohorts import CohortTrainer
from fedprivacy.engines.inprocess import InProcessGrid
from fedprivacy.fl import client_app
from fedprivacy.fl.client_app import LEGACY_RESIDUAL, RESIDUAL, adopt_legacy_residual, build_client_app
from fedprivacy.fl.mods import RESIDUAL_KEY
from fedprivacy.fl.records import model_to_record
from fedprivacy.updates import SparseUpdate
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task


def _trained(model, labels, rng) -> LocalResult:
    """A stand-in for local training, a function of the client's data and its data-order generator:
    500 coordinates of norm about 22 (so clipping and top-k act), a loss and the example count."""
    d = sum(p.numel() for p in model.parameters())
    indices = torch.from_numpy(np.sort(rng.choice(d, 500, replace=False)))
    values = torch.from_numpy(rng.standard_normal(500).astype(np.float32))
    return LocalResult(SparseUpdate(indices, values, d), float(rng.random()), len(labels))


def _one(model, features, labels, *, rng, **kw):  # stands in for local_sgd (one client)
    return _trained(model, labels, rng)


def _together(model, data, *, rngs, **kw):  # stands in for train_sparse_cohort (a chunk)
    return [_trained(model, labels, rng) for (_, labels), rng in zip(data, rngs)]


def _messages(task, rounds_and_nodes, clip_norm):
    record = model_to_record(task.new_model())
    return [Message(RecordDict({"arrays": record, "config": ConfigRecord({"server-round": t, "clip-norm": clip_norm,
                                                                          "noise-epoch": 1})}),
                    dst_node_id=partition + 2, message_type="train") for t, partition in rounds_and_nodes]


def _bytes(reply: Message) -> dict:
    """A reply's content as plain values: every array's dtype, shape and bytes, every metric."""
    content = reply.content
    return {"keys": list(content.keys()),
            "arrays": {k: (a.dtype, tuple(a.shape), bytes(a.data)) for k, a in content["arrays"].items()},
            "metrics": list(content["metrics"].items())}


@pytest.mark.parametrize("overrides", [
    (),
    ("privacy.placement=distributed",),
    ("privacy.placement=local",),
    ("client.compression={density: 0.002, quantization: 4bit_stochastic, bucket_size: 100, per_tensor: true}",),
    ("client.compression={density: 0.002, quantization: 4bit}",),
], ids=["central", "distributed", "local", "compression-stochastic-per-tensor", "compression-4bit"])
def test_the_cohort_engine_replies_what_the_client_app_replies_bit_for_bit(small_config, monkeypatch, overrides):
    monkeypatch.setattr(client_app, "local_sgd", _one)
    monkeypatch.setattr(cohorts, "train_sparse_cohort", _together)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    cfg = small_config(*overrides)
    task = load_task(cfg.data)
    jobs = [(3, p) for p in (0, 5, 7, 12)] + [(4, p) for p in (1, 2)]  # each node's first participation
    one_at_a_time = InProcessGrid(build_client_app(cfg), task.population)
    together = InProcessGrid(build_client_app(cfg), task.population,
                             cohort=CohortTrainer(cfg, task, task.new_model(cfg.device)))
    assert together.cohort.handles(_messages(task, jobs, 0.7))
    want = {r.metadata.src_node_id: _bytes(r) for r in one_at_a_time.send_and_receive(_messages(task, jobs, 0.7))}
    got = {r.metadata.src_node_id: _bytes(r) for r in together.send_and_receive(_messages(task, jobs, 0.7))}
    assert got == want and len(want) == len(jobs)  # (the cohort replies in its chunks' order)
    dense = cfg.privacy.placement != "central"  # client noise covers every coordinate
    assert all(("indices" in w["arrays"]) != dense for w in want.values())
    # an untrusted server (distributed, local) gets the noisy upload only: no loss, count or residual size
    assert all(("train_loss" in dict(w["metrics"])) != dense for w in want.values())
    assert not dense or all(w["metrics"] == [] for w in want.values())
    if cfg.client.compression is not None:
        assert all(dict(w["metrics"])["residual-bytes"] > 0 for w in want.values())
        assert {node - 2 for node in one_at_a_time.node_state_dict()} == {p for _, p in jobs}
        # the cohort reads and keeps each node's residual as the ClientApp does: the next round's replies match too
        assert _states(together) == _states(one_at_a_time)
        later = [(5, p) for _, p in jobs]
        want = [_bytes(r) for r in one_at_a_time.send_and_receive(_messages(task, later, 0.7))]
        got = {r.metadata.src_node_id: _bytes(r) for r in together.send_and_receive(_messages(task, later, 0.7))}
        assert sorted(map(str, got.values())) == sorted(map(str, want)) and _states(together) == _states(one_at_a_time)


def _states(grid: InProcessGrid) -> dict:
    """The grid's node states as plain values: every array's bytes by node and key."""
    return {node: {key: {name: bytes(a.data) for name, a in state[key].items()} for key in state.array_records}
            for node, state in grid.node_state_dict().items()}


def test_the_client_app_and_the_mods_keep_the_residual_under_one_key():
    assert RESIDUAL == RESIDUAL_KEY != LEGACY_RESIDUAL


def _final(folder) -> dict:
    return torch.load(folder / "final_model.pt")


def test_a_checkpoint_with_the_former_residual_key_resumes_bit_exactly(small_config, tmp_path):
    opts = ("client.compression={density: 0.02, quantization: 4bit_stochastic, bucket_size: 1000}",)
    run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'full'}"))
    run(small_config("rounds=2", *opts, f"output_dir={tmp_path / 'old'}"))
    path = tmp_path / "old" / "checkpoint.pt"
    state = torch.load(path, weights_only=False)
    assert state["node_states"]
    for node_state in state["node_states"].values():  # as fedprivacy's ClientApp kept it before issue 30
        node_state[LEGACY_RESIDUAL] = node_state[RESIDUAL]
        del node_state[RESIDUAL]
    torch.save(state, path)
    run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'old'}"), resume=True)
    full, resumed = _final(tmp_path / "full"), _final(tmp_path / "old")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    keys = {k for s in torch.load(path, weights_only=False)["node_states"].values() for k in s.keys()}
    assert keys == {RESIDUAL}


def test_a_node_state_with_both_residual_keys_is_refused():
    from flwr.app import ArrayRecord

    state = RecordDict({LEGACY_RESIDUAL: ArrayRecord(), RESIDUAL: ArrayRecord()})
    with pytest.raises(ValueError, match="both 'uplink-residual' and 'fedprivacy-uplink-residual'"):
        adopt_legacy_residual(state)
    assert not adopt_legacy_residual(RecordDict({RESIDUAL: ArrayRecord()}))
