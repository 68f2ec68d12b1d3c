"""Issue 21 item 5: each client's delta is well below 1 / n_i, clients of any size run, epsilons are never negative."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedprivacy.cli import main
from fedprivacy.client.sample_dp import DELTA_FACTOR, client_delta, train_sample_dp_softmax
from fedprivacy.models.logistic import SparseLogisticRegression
from fedprivacy.optim.sample_dp import SampleDPConfig
from fedprivacy.privacy.accounting import GaussianRound, epsilon, epsilon_for, json_epsilon
from fedprivacy.privacy.client_ledgers import ClientLedgers
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")

V, K = 7, 3


def test_default_delta_is_a_tenth_of_one_over_n_and_a_fixed_delta_overrides():
    assert DELTA_FACTOR == 0.1
    for n in (1, 2, 3, 10, 10**6):
        assert client_delta(n) == pytest.approx(0.1 / n) and client_delta(n) < 1 / n
    assert client_delta(1, delta_factor=0.5) == 0.5 and client_delta(7, target_delta=1e-5) == 1e-5
    with pytest.raises(ValueError, match="delta_factor"):
        client_delta(5, delta_factor=1.0)


def _tiny_client(n):
    rng = np.random.default_rng(n)
    x = sp.csr_matrix(sp.random(n, V, density=0.5, format="csr", random_state=rng, dtype=np.float32))
    return SparseLogisticRegression(V, K), x, rng.integers(0, K, n)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_one_and_two_record_clients_report_a_small_delta_and_a_nonnegative_epsilon(n, accountant):
    model, x, y = _tiny_client(n)
    cfg = SampleDPConfig(base="sgd", lr=0.1, noise_multiplier=1.0, clip_norm=1.0, batch_size=4.0)
    result = train_sample_dp_softmax(model, x, y, cfg, 0, accountant=accountant)
    assert result.target_delta == pytest.approx(0.1 / n) and result.target_delta < 1 / n
    assert 0 <= result.epsilon < math.inf and torch.isfinite(result.delta).all()
    weak = train_sample_dp_softmax(model, x, y, cfg, 0, accountant=accountant, target_delta=0.9)
    assert weak.epsilon >= 0  # Opacus' own accountant: negative (rdp), or "Cannot compute epsilon" (prv)
    noiseless = SampleDPConfig(base="sgd", lr=0.1, noise_multiplier=0.0, clip_norm=1.0, batch_size=4.0)
    assert train_sample_dp_softmax(model, x, y, noiseless, 0, accountant=accountant).epsilon == math.inf


def test_a_client_with_fewer_records_than_a_micro_batch_has_one_unit_of_all_of_them():
    model, x, y = _tiny_client(1)
    cfg = SampleDPConfig(base="sgd", lr=0.1, noise_multiplier=1.0, clip_norm=1.0, batch_size=4.0, micro_batch_size=3)
    result = train_sample_dp_softmax(model, x, y, cfg, 0)
    assert result.event == GaussianRound(1.0, "poisson", 1, 1.0) and result.target_delta == 0.1
    assert 0 <= result.epsilon < math.inf and torch.isfinite(result.delta).all() and result.delta.abs().sum() > 0


@pytest.mark.parametrize("kind", ["rdp", "prv", "pld"])
def test_epsilon_at_a_large_delta_is_zero_not_negative(kind):
    """delta = 1/2 of one step at q = 2/2, z = 1 (the tester's 2-post client): PRV gave -0.364, RDP -0.454 at z = 2."""
    for z in (1.0, 2.0):
        eps = epsilon([(GaussianRound(z, "poisson", 2, 2.0), 1)], 0.5, kind)
        assert eps >= 0 and not math.isnan(eps)
    assert epsilon([(GaussianRound(1.0, "poisson", 1, 1.0), 1)], 0.9, kind) == 0.0


@settings(max_examples=30, deadline=None)
@given(q=st.floats(1e-3, 1.0), z=st.floats(0.5, 5.0), steps=st.integers(0, 30), delta=st.floats(1e-7, 0.999),
       kind=st.sampled_from(["rdp", "prv", "pld"]))
def test_reported_epsilon_is_never_negative_or_nan(q, z, steps, delta, kind):
    eps = epsilon_for("poisson", q, z, steps, delta, kind)
    assert eps >= 0 and not math.isnan(eps)


def test_json_epsilon_writes_inf_as_a_string():
    assert json_epsilon(math.inf) == "inf" and json_epsilon(1.5) == 1.5 and json_epsilon(None) is None


def _strict_json(text):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("z,delta", [("1", "0.5"), ("2", "0.5"), ("1", "0.9")])
def test_cli_epsilon_at_a_large_delta_is_never_negative(capsys, z, delta):
    assert main(["epsilon", "--sampling", "poisson", "--q", "1", "--noise-multiplier", z, "--steps", "1",
                 "--delta", delta, "--accountant", "all"]) == 0
    eps = _strict_json(capsys.readouterr().out)["epsilon"]
    assert set(eps) == {"rdp", "prv", "pld"} and all(v >= 0 for v in eps.values())


def test_cli_epsilon_without_noise_prints_inf_as_strict_json(capsys):
    assert main(["epsilon", "--sampling", "poisson", "--q", "0.1", "--noise-multiplier", "0", "--steps", "3",
                 "--delta", "1e-5"]) == 0
    assert _strict_json(capsys.readouterr().out)["epsilon"] == {"rdp": "inf", "prv": "inf", "pld": "inf"}


def test_client_ledgers_flag_a_delta_of_at_least_one_over_n(tmp_path, caplog):
    ledgers = ClientLedgers()
    ledgers.compose(0, GaussianRound(1.0, "poisson", 4, 4.0), 3, delta=client_delta(4))
    ledgers.compose(1, GaussianRound(1.0, "poisson", 4, 4.0), 3, delta=0.25)
    ledgers.compose(2, GaussianRound(0.0, "poisson", 4, 4.0), 3, delta=0.01)
    ledgers.write_csv(tmp_path / "c.csv", 1e-5, ["rdp", "prv"])
    rows = pd.read_csv(tmp_path / "c.csv")
    assert rows["weak_delta"].tolist() == [False, True, False] and "1 client(s) have delta >= 1" in caplog.text
    assert (rows[["epsilon_rdp", "epsilon_prv"]] >= 0).all().all() and rows["epsilon_rdp"][2] == math.inf
    summary = ledgers.summary(1e-5, "rdp")
    assert summary["client_epsilon_max"] == "inf" and summary["client_weak_delta_clients"] == 1.0
    _strict_json(json.dumps(summary))


@pytest.mark.slow
@pytest.mark.parametrize("posts,micro_batch", [(1, "null"), (2, "null"), (1, "2")])
def test_a_run_of_tiny_clients_finishes_and_reports_every_client(small_config, posts, micro_batch):
    """Every client holds ``posts`` posts (one unit each with micro-batches of 2): delta_i = 0.1 / units,
    a summary and client_privacy.csv are written."""
    cfg = small_config(f"data.max_examples_per_client={posts}", "client.sample_dp.batch_size=4",
                       f"client.sample_dp.micro_batch_size={micro_batch}", "client.sample_dp.accountant=prv",
                       "privacy.accountants=[rdp,prv,pld]")
    summary = run(cfg)
    assert summary["rounds_completed"] == 2 and (cfg.output_dir / "summary.json").exists()
    clients = pd.read_csv(cfg.output_dir / "client_privacy.csv")
    task = load_task(cfg.data)
    assert len(clients) and all(task.client_data(int(c))[0].shape[0] == posts for c in clients["client"])
    assert np.allclose(clients["delta"], 0.1 / posts, rtol=1e-15) and not clients["weak_delta"].any()
    eps = clients[["epsilon_rdp", "epsilon_prv", "epsilon_pld"]]
    assert (eps >= 0).all().all() and np.isfinite(eps).all().all()
    assert summary["client_weak_delta_clients"] == 0.0


@pytest.mark.slow
def test_a_fixed_delta_of_at_least_one_over_n_is_flagged_not_fatal(small_config):
    cfg = small_config("data.max_examples_per_client=2", "client.sample_dp.target_delta=0.5",
                       "privacy.accountants=[rdp,prv,pld]")
    summary = run(cfg)
    clients = pd.read_csv(cfg.output_dir / "client_privacy.csv")
    assert clients["weak_delta"].all() and summary["client_weak_delta_clients"] == len(clients)
    assert (clients[["epsilon_rdp", "epsilon_prv", "epsilon_pld"]] >= 0).all().all()
