"""Every server optimizer through the same pipeline: runs, consumes only the released g, resumes exactly."""

import pandas as pd
import pytest
import torch

from fedprivacy.config import ConfigError, config_from_json
from fedprivacy.run import run

VARIANTS = {
    "adam": ("server.optimizer=adam", "server.lr=0.03"),
    "yogi": ("server.optimizer=yogi", "server.lr=0.03"),
    "adagrad": ("server.optimizer=adagrad", "server.lr=0.1"),
    "adambc": ("server.optimizer=adambc", "server.lr=0.003"),
    "microadam": ("server.optimizer=microadam", "server.lr=0.03",
                  "server.microadam={density: 0.05, ring_size: 3, bucket_size: 1000, stochastic_rounding: true}"),
    "disk+adam": ("server.optimizer=adam", "server.lr=0.03", "server.disk={kappa: 0.7, gamma: 0.5}"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_resume_is_bit_exact_for_every_server_optimizer(small_config, tmp_path, name):
    opts = VARIANTS[name]
    full = small_config("rounds=4", *opts, f"output_dir={tmp_path / 'full'}")
    run(full)
    run(small_config("rounds=2", *opts, f"output_dir={tmp_path / 'part'}"))
    run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'part'}"), resume=True)
    a = torch.load(tmp_path / "full" / "final_model.pt")
    b = torch.load(tmp_path / "part" / "final_model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), name
    assert not torch.equal(a["bias"], torch.load(tmp_path / "full" / "initial_model.pt")["bias"])
    df = pd.read_csv(tmp_path / "full" / "metrics.csv")
    assert df["epsilon_rdp"].notna().all()


def test_microadam_reports_a_sparse_downlink(small_config):
    cfg = small_config("rounds=3", *VARIANTS["microadam"])
    run(cfg)
    df = pd.read_csv(cfg.output_dir / "metrics.csv")
    dense = 4 * 100_050
    assert df["downlink_bytes_per_client"].iloc[0] == dense  # round 1: the whole model
    assert (df["downlink_bytes_per_client"].iloc[1:] < dense).all()


def test_adaptive_servers_see_the_noise_and_the_epsilon_is_the_mechanisms(small_config, tmp_path):
    # same mechanism => same epsilon, whatever the server does with g (post-processing)
    eps = {}
    for name in ("adam", "adambc"):
        cfg = small_config("rounds=2", *VARIANTS[name], f"output_dir={tmp_path / name}")
        eps[name] = run(cfg)["epsilon_rdp"]
    sgd = small_config("rounds=2", f"output_dir={tmp_path / 'sgd'}")
    assert eps["adam"] == eps["adambc"] == run(sgd)["epsilon_rdp"]
    floored = pd.read_csv(tmp_path / "adambc" / "metrics.csv")["adambc_floored_fraction"]
    assert len(floored) == 2 and floored.between(0.0, 1.0).all()
    assert "adambc_floored_fraction" not in pd.read_csv(tmp_path / "adam" / "metrics.csv")


def test_settings_an_optimizer_does_not_read_are_refused(small_config):
    with pytest.raises(ConfigError, match="momentum"):
        small_config("server.optimizer=adam", "server.momentum=0.5")
    with pytest.raises(ConfigError, match="microadam"):
        small_config("server.microadam={density: 0.1}")


@pytest.mark.parametrize("name", ["sgd", *VARIANTS])
def test_a_written_config_loads_back_for_every_server_optimizer(small_config, name):
    """``config.yaml``, checkpoints, sweeps and deployments rebuild a run from ``to_json()``: it must
    validate again (sgd keeps its default momentum 0.9; the others have none to refuse)."""
    cfg = small_config(*VARIANTS.get(name, ()))
    again = config_from_json(cfg.to_json())
    assert again == cfg
    assert again.server.momentum == (0.9 if name == "sgd" else None)
