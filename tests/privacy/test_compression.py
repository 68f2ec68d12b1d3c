"""Uplink compression with error feedback (issue "Client side", deliverable 2): density 1 is the plain
clipped delta, error-feedback conservation, the clip bounds what is sent, the residual survives a
client's absence, resume keeps it, and the server still adds dense noise."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fedprivacy.client.compression import Residual, compress, flat_coo
from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.config import ConfigError
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl.client_app import RESIDUAL, build_client_app
from fedprivacy.fl.records import load_record_, record_to_arrays, record_to_update
from fedprivacy.fl.server_app import build_server_app
from fedprivacy.privacy.sampling import make_sampler
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task
from fedprivacy.updates import SparseUpdate

D = 60


def _updates(seed=0):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(D, generator=gen)
    flat = SparseUpdate(torch.tensor([1, 4, 5, 17, 40]), torch.randn(5, generator=gen), D)
    block = SparseUpdate(torch.tensor([0, 3, 7]), torch.randn(3, 6, generator=gen), D)  # rows of 6
    return {"dense": SparseUpdate.dense(dense), "flat": flat, "block": block}


def _residual(seed=1) -> Residual:
    gen = torch.Generator().manual_seed(seed)
    idx = np.sort(np.random.default_rng(seed).choice(D, 25, replace=False)).astype(np.int32)
    return Residual(idx, values=torch.randn(25, generator=gen).numpy())


@pytest.mark.parametrize("kind", ["dense", "flat", "block"])
def test_density_one_without_quantization_sends_the_clipped_delta(kind):
    update = _updates()[kind]
    idx, val = flat_coo(update)
    for clip in (1e9, 0.5):  # unclipped, clipped
        out = compress(update, None, density=1.0, clip_norm=clip, quantization="none")
        scale = min(1.0, clip / float(val.norm()))
        assert torch.equal(out.sent.indices, idx) and torch.allclose(out.sent.values, val * scale, rtol=1e-6)
        assert out.residual is None  # nothing left over: the clip's excess is dropped, as in DP-FedAvg
        assert torch.allclose(out.sent.to_dense(), update.to_dense() * scale, rtol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "flat", "block"])
def test_error_feedback_conservation(kind):
    """T_k(a) + e_new = a = Delta + e_old, exactly without quantisation (the clip acts on T_k(a) only)."""
    update, old = _updates()[kind], _residual()
    owed = update.to_dense().clone()
    owed[torch.from_numpy(old.indices.astype(np.int64))] += torch.from_numpy(old.values)
    out = compress(update, old, density=0.1, clip_norm=1e9, quantization="none")
    left = torch.zeros(D)
    left[torch.from_numpy(out.residual.indices.astype(np.int64))] = out.residual.dequantized()
    assert torch.allclose(out.sent.to_dense() + left, owed, atol=1e-6)
    assert len(out.sent.indices) == math.ceil(0.1 * D)
    kept = owed.abs()[out.sent.indices]
    assert float(kept.min()) >= float(owed.abs()[left != 0].max())  # the largest magnitudes are the ones sent
    clipped = compress(update, old, density=0.1, clip_norm=0.3, quantization="none")
    assert torch.allclose(clipped.residual.dequantized(), out.residual.dequantized())  # the clip changes only s


@pytest.mark.parametrize("stochastic", [False, True])
def test_quantised_residual_is_within_half_a_step_or_unbiased(stochastic):
    update, old = _updates()["dense"], _residual()
    exact = compress(update, old, density=0.2, clip_norm=1e9, quantization="none").residual
    rounds = []
    for seed in range(1 if not stochastic else 400):
        q = compress(update, old, density=0.2, clip_norm=1e9, quantization="4bit_stochastic" if stochastic else "4bit",
                     bucket_size=16, generator=torch.Generator().manual_seed(seed)).residual
        assert np.array_equal(q.indices, exact.indices)
        step = np.repeat(q.scales, 16)[:len(q.indices)]
        err = (q.dequantized() - torch.from_numpy(exact.values)).numpy()
        assert (np.abs(err) <= step * (1.0 if stochastic else 0.5) + 1e-6).all()
        rounds.append(q.dequantized())
        assert q.nbytes < exact.nbytes
    if stochastic:  # unbiased: the mean of 400 draws is within 4 standard errors of the exact residual
        mean = torch.stack(rounds).mean(0)
        step = torch.from_numpy(np.repeat(q.scales, 16)[:len(q.indices)])
        assert ((mean - torch.from_numpy(exact.values)).abs() <= 4 * 0.5 * step / math.sqrt(400) + 1e-6).all()


def test_the_clip_bounds_the_transmitted_vector_not_the_pre_feedback_delta():
    small = SparseUpdate.dense(torch.full((D,), 1e-3))  # ||Delta|| << C, but the residual is large
    big = Residual(np.arange(D, dtype=np.int32), values=np.full(D, 5.0, dtype=np.float32))
    out = compress(small, big, density=0.5, clip_norm=1.0, quantization="none")
    assert float(small.values.norm()) < 1.0 < out.owed_norm
    assert float(out.sent.values.norm()) == pytest.approx(1.0, rel=1e-6)


def test_per_tensor_top_k_budgets_each_tensor():
    update = _updates()["dense"]
    out = compress(update, None, density=0.1, clip_norm=1e9, quantization="none", tensor_sizes=[6, 54])
    first = int((out.sent.indices < 6).sum())
    assert first == math.ceil(0.1 * 6) and len(out.sent.indices) - first == math.ceil(0.1 * 54)


@pytest.mark.parametrize("tensor_sizes", [None, [10, 40, 50]])
def test_a_dense_update_selects_what_dp_microadams_top_k_selects(tensor_sizes):
    """One top-k (optim/microadam.top_k_per_block): at density * n integral the budgets agree too."""
    from fedprivacy.optim.microadam import top_k

    values = torch.randn(100, generator=torch.Generator().manual_seed(3))
    out = compress(SparseUpdate.dense(values), None, density=0.1, clip_norm=1e9, quantization="none",
                   tensor_sizes=tensor_sizes)
    indices, picked = top_k(values, 10, tensor_sizes)
    assert torch.equal(out.sent.indices.long(), indices) and torch.equal(out.sent.values, picked)


# -- through the Flower apps -------------------------------------------------------------------------


def _final(cfg) -> torch.Tensor:
    state = torch.load(cfg.output_dir / "final_model.pt")
    return torch.cat([state["bias"].reshape(-1), state["embedding.weight"].reshape(-1)])


def _final_initial(cfg) -> torch.Tensor:
    state = torch.load(cfg.output_dir / "initial_model.pt")
    return torch.cat([state["bias"].reshape(-1), state["embedding.weight"].reshape(-1)])


def test_density_one_run_equals_dp_fedavg(small_config, tmp_path):
    plain = small_config("rounds=3", f"output_dir={tmp_path / 'plain'}")
    full = small_config("rounds=3", "client.compression={density: 1.0, quantization: none}",
                        f"output_dir={tmp_path / 'full'}")
    run(plain)
    run(full)
    assert pd.read_csv(plain.output_dir / "metrics.csv")["clipped_fraction"].max() > 0
    # the client scales by min(1, C/||u||) before sending instead of the server while summing: float32
    # rounding differs (~1e-7 relative), and local training with lr 5 carries it into later rounds
    torch.testing.assert_close(_final(full), _final(plain), rtol=1e-4, atol=2e-5)
    assert (_final(full) - _final(plain)).abs().max() < 1e-3 * (_final(plain) - _final_initial(plain)).abs().max()


def test_residual_survives_a_clients_absence_and_feeds_its_next_upload(small_config):
    cfg = small_config("rounds=5", "client.compression={density: 0.02, quantization: 4bit, bucket_size: 4096}")
    task = load_task(cfg.data)
    sampler = make_sampler("poisson", task.population, cfg.privacy.expected_cohort, cfg.seed)
    rounds = [set(sampler.sample().tolist()) for _ in range(cfg.rounds)]
    client, first, later = next((p, t1, t2) for p in range(task.population)
                                for t1 in range(cfg.rounds) for t2 in range(t1 + 2, cfg.rounds)
                                if p in rounds[t1] and p in rounds[t2] and all(p not in r for r in rounds[t1 + 1:t2]))
    seen = {}

    def spy(msg, context, call_next):
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) == client:
            t = int(msg.content["config"]["server-round"])
            before = context.state.array_records.get(RESIDUAL)
            reply = call_next(msg, context)
            seen[t] = (msg, None if before is None else dict(record_to_arrays(before)),
                       dict(record_to_arrays(context.state[RESIDUAL])), reply)
            return reply
        return call_next(msg, context)

    run_inprocess(build_server_app(cfg), build_client_app(cfg, mods=[spy]), task.population)
    t1, t2 = first + 1, later + 1
    assert seen[t1][1] is None and set(seen) == {t for t in range(1, 6) if client in rounds[t - 1]}
    kept, used = seen[t1][2], seen[t2][1]
    assert all(np.array_equal(kept[k], used[k]) for k in kept)  # untouched while the client sat out
    msg, _, _, reply = seen[t2]
    model = task.new_model()
    load_record_(model, msg.content["arrays"])
    delta = local_sgd(model, *task.client_data(client), epochs=1, batch_size=10, lr=5.0,
                      rng=client_generator(cfg.seed, t2, client)).update
    expected = compress(delta, Residual.from_arrays(used), density=0.02, clip_norm=1.0, quantization="4bit",
                        bucket_size=4096).sent
    got = record_to_update(reply.content["arrays"], 100_050)
    assert torch.equal(got.indices, expected.indices) and torch.allclose(got.values, expected.values, rtol=1e-6)
    without = compress(delta, None, density=0.02, clip_norm=1.0, quantization="none").sent
    assert not torch.equal(without.indices, expected.indices)  # the residual changed what was sent


def test_uplink_bytes_are_reported_and_the_server_noise_stays_dense(small_config, tmp_path):
    plain = small_config("rounds=2", f"output_dir={tmp_path / 'p'}")
    comp = small_config("rounds=2", "client.lr=0", "client.compression={density: 0.01}",
                        "privacy.noise_multiplier=2", f"output_dir={tmp_path / 'c'}")
    run(plain)
    run(comp)
    p, c = pd.read_csv(plain.output_dir / "metrics.csv"), pd.read_csv(comp.output_dir / "metrics.csv")
    k = math.ceil(0.01 * 100_050)
    assert (c["uplink_bytes_per_client"] < k * 8 + 300).all()  # int32 index + float32 value each, 2 headers
    assert (c["uplink_bytes_per_client"] < p["uplink_bytes_per_client"]).all()
    change = _final(comp) - torch.cat([t.reshape(-1) for t in torch.load(comp.output_dir / "initial_model.pt").values()])
    assert float((change == 0).float().mean()) < 1e-3  # zero client lr: the model moves by noise on EVERY coordinate


def test_resume_keeps_each_clients_residual_and_is_bit_exact(small_config, tmp_path):
    opts = ("client.compression={density: 0.02, quantization: 4bit_stochastic, bucket_size: 1000}",)
    full = small_config("rounds=4", *opts, f"output_dir={tmp_path / 'full'}")
    run(full)
    run(small_config("rounds=2", *opts, f"output_dir={tmp_path / 'part'}"))
    run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'part'}"), resume=True)
    assert torch.equal(_final(full), torch.cat([torch.load(tmp_path / "part" / "final_model.pt")[k].reshape(-1)
                                                for k in ("bias", "embedding.weight")]))
    lost = small_config("rounds=4", *opts, f"output_dir={tmp_path / 'lost'}")
    run(small_config("rounds=2", *opts, f"output_dir={tmp_path / 'lost'}"))
    state = torch.load(tmp_path / "lost" / "checkpoint.pt", weights_only=False)
    assert state["node_states"]  # the residuals are in the checkpoint ...
    state["node_states"] = {}
    torch.save(state, tmp_path / "lost" / "checkpoint.pt")
    run(lost, resume=True)  # ... and without them the run differs
    assert not torch.equal(_final(full), torch.cat([torch.load(tmp_path / "lost" / "final_model.pt")[k].reshape(-1)
                                                    for k in ("bias", "embedding.weight")]))


@pytest.mark.parametrize("overrides,field", [
    (["client.compression.density=0"], "client.compression.density"),
    (["client.compression.quantization=2bit"], "client.compression.quantization"),
    (["client.compression.density=0.1", "privacy.placement=distributed"], "privacy.placement"),
])
def test_config_errors_name_the_field(small_config, overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        small_config(*overrides)
