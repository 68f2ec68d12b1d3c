"""Federated AdaDPS (Alg. 3) through the Flower apps: A = 1 is DP-FedAvg, the scale invariance with the
same noise draws, A sent to each node once and kept in its Context.state, provenance, resume."""

import json
from collections import Counter

import pandas as pd
import pytest
import torch

from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.records import tensors_to_record
from fedprivacy.fl.server_app import build_server_app
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task


def _final(cfg) -> torch.Tensor:
    state = torch.load(cfg.output_dir / "final_model.pt")
    return torch.cat([state["bias"].reshape(-1), state["embedding.weight"].reshape(-1)])


@pytest.mark.parametrize("extra", [(), ("client.sample_dp={optimizer: sgd, lr: 0.05, batch_size: 4, epochs: 0.5}",)])
def test_unit_side_information_is_dp_fedavg_exactly(small_config, tmp_path, extra):
    # both one client at a time: the tag task's cohort path equals it within float rounding only
    # (tests/engine/test_cohort_variants.py)
    plain = small_config("rounds=2", "cohort_batching=off", *extra, f"output_dir={tmp_path / 'plain'}")
    ones = small_config("rounds=2", "cohort_batching=off", *extra, "client.adadps.source=ones",
                        f"output_dir={tmp_path / 'ones'}")
    run(plain)
    run(ones)
    assert torch.equal(_final(plain), _final(ones))


def test_scale_invariance_with_one_local_step_and_the_same_noise(small_config, tmp_path):
    """One local step (a batch larger than any client): Delta(cA) = Delta(A) / c, so clip(., C) and noise zC
    equal those of (A, cC) divided by c, and server lr / c gives the same model (arXiv:2202.05963)."""
    c, side = 3.0, "client.adadps={source: rmsprop, precondition_bias: true%s}"  # A on every coordinate
    common = ("rounds=2", "client.batch_size=100000", "client.lr=0.05", "server.momentum=0", "data.public_clients=4",
              "privacy.noise_multiplier=0.7")
    scaled_a = small_config(*common, "privacy.clip_norm=0.4", side % ", scale: 3.0", f"output_dir={tmp_path / 'a'}")
    scaled_c = small_config(*common, f"privacy.clip_norm={0.4 * c}", f"server.lr={1 / c}", side % "",
                            f"output_dir={tmp_path / 'c'}")
    plain = small_config(*common, "privacy.clip_norm=0.4", side % "", f"output_dir={tmp_path / 'p'}")
    for cfg in (scaled_a, scaled_c, plain):
        run(cfg)
    clipped = pd.read_csv(scaled_a.output_dir / "metrics.csv")["clipped_fraction"]
    assert ((clipped > 0) & (clipped < 1)).any()  # some updates clipped, some not: the scale matters
    torch.testing.assert_close(_final(scaled_a), _final(scaled_c), rtol=1e-4, atol=1e-6)  # float32 paths differ
    assert (_final(scaled_a) - _final(plain)).abs().max() > 100 * 1e-6


def _recorder(seen: Counter):
    def mod(msg, context, call_next):
        if msg.metadata.message_type == "train" and "adadps" in msg.content.array_records:
            seen[int(context.node_config["partition-id"])] += 1
        return call_next(msg, context)
    return mod


def _forgetful(partition: int, at_round: int):
    """A node whose device lost its storage just before round ``at_round``."""
    def mod(msg, context, call_next):
        if (msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) == partition
                and int(msg.content["config"]["server-round"]) == at_round):
            for key in list(context.state.keys()):
                del context.state[key]
        return call_next(msg, context)
    return mod


def _participations(cfg) -> Counter:
    """Which partitions each round samples (the server's sampler is seeded: replay it)."""
    from fedprivacy.privacy.sampling import make_sampler

    sampler = make_sampler("poisson", load_task(cfg.data).population, cfg.privacy.expected_cohort, cfg.seed)
    return [set(sampler.sample().tolist()) for _ in range(cfg.rounds)]


def test_side_information_is_sent_to_each_node_once_and_kept_in_its_state(small_config):
    cfg = small_config("rounds=4", "client.adadps.source=top_words")
    seen: Counter = Counter()
    run_inprocess(build_server_app(cfg), build_client_app(cfg, mods=[_recorder(seen)]), load_task(cfg.data).population)
    rounds = _participations(cfg)
    participants = set().union(*rounds)
    assert set(seen) == participants and set(seen.values()) == {1}
    df = pd.read_csv(cfg.output_dir / "metrics.csv")
    per_node = len(tensors_to_record({"embedding.weight": torch.ones(2000, 1)})["embedding.weight"].data)
    assert 2000 * 4 < per_node < 2000 * 4 + 256  # A is (V, 1) float32 (+ the .npy header)
    first_time = [len(r - set().union(*rounds[:t])) for t, r in enumerate(rounds)]
    assert df["side_information_bytes"].tolist() == [per_node * n for n in first_time]
    assert df["cohort_accepted"].tolist() == [len(r) for r in rounds]


def test_a_node_that_lost_its_side_information_drops_out_and_gets_it_again(small_config):
    cfg = small_config("rounds=6", "client.adadps.source=top_words")
    rounds = _participations(cfg)
    repeat = next(p for p in rounds[0] if sum(p in r for r in rounds) >= 3)  # in round 1 and twice more
    second, third = [t + 1 for t, r in enumerate(rounds) if repeat in r][1:3]
    seen: Counter = Counter()
    run_inprocess(build_server_app(cfg), build_client_app(cfg, mods=[_forgetful(repeat, second), _recorder(seen)]),
                  load_task(cfg.data).population)
    df = pd.read_csv(cfg.output_dir / "metrics.csv").set_index("round")
    assert df.loc[second, "cohort_accepted"] == len(rounds[second - 1]) - 1  # its round-`second` reply failed
    assert seen[repeat] == 2  # sent in round 1, and again in round `third` after the failure
    assert df.loc[third, "cohort_accepted"] == len(rounds[third - 1])


def test_provenance_is_written_and_rmsprop_refreshes_at_released_models(small_config):
    cfg = small_config("rounds=3", "data.public_clients=4",
                       "client.adadps={source: rmsprop, refresh_every: 2, public_batch_size: 8}")
    summary = run(cfg)
    builds = json.loads((cfg.output_dir / "side_information.json").read_text())
    assert [b["released_round"] for b in builds] == [0, 2]
    assert all(b["source"] == "rmsprop" and b["public"] and b["public_pool"]["split"] == "heldout" for b in builds)
    assert builds[0]["tensors"]["embedding.weight"]["shape"] == [2000, 50] and "bias" not in builds[0]["tensors"]
    assert builds[0]["sha256"] != builds[1]["sha256"]
    assert summary["side_information"]["sha256"] == builds[1]["sha256"]
    assert "AdaDPS side information" in summary["privacy_claim"]
    df = pd.read_csv(cfg.output_dir / "metrics.csv")
    assert df["side_information_bytes"].iloc[2] > 0  # round 3: the new version is sent again


def test_resume_keeps_the_side_information_and_is_bit_exact(small_config, tmp_path):
    opts = ("data.public_clients=4", "client.adadps={source: rmsprop, refresh_every: 3}")
    full = small_config("rounds=4", *opts, f"output_dir={tmp_path / 'full'}")
    run(full)
    run(small_config("rounds=2", *opts, f"output_dir={tmp_path / 'part'}"))
    run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'part'}"), resume=True)
    assert torch.equal(torch.load(tmp_path / "full" / "final_model.pt")["embedding.weight"],
                       torch.load(tmp_path / "part" / "final_model.pt")["embedding.weight"])
    a = json.loads((tmp_path / "full" / "side_information.json").read_text())
    b = json.loads((tmp_path / "part" / "side_information.json").read_text())
    assert [x["sha256"] for x in a] == [x["sha256"] for x in b]


def test_multilabel_task_trains_with_side_information(small_config, tmp_path):
    plain = small_config("data.task=tag_multilabel", f"output_dir={tmp_path / 'p'}")
    ones = small_config("data.task=tag_multilabel", "client.adadps.source=ones", f"output_dir={tmp_path / 'o'}")
    top = small_config("data.task=tag_multilabel", "client.adadps.source=top_words", f"output_dir={tmp_path / 't'}")
    for cfg in (plain, ones, top):
        run(cfg)
    assert torch.equal(_final(plain), _final(ones))
    assert not torch.allclose(_final(plain), _final(top))
