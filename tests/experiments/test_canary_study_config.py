"""configs/canaries_study_e.yaml is study (e)'s selected DP-FedAvg run (configs/study_e_lr_grid.yaml at the server
rate its stored summary selected) with canaries: the same mechanism, data and training, plus ``privacy.canaries``."""

import json
from pathlib import Path

from fedprivacy.config import load_config
from fedprivacy.experiments.docs import load_summary
from fedprivacy.experiments.study import expand, load_study

REPO = Path(__file__).resolve().parents[2]


def test_the_canary_config_is_the_grids_selected_dp_fedavg_run_plus_canaries():
    selected = load_summary(REPO / "docs" / "results" / "study_e_lr_grid.json").summary().set_index("method")
    assert selected.loc["DP-FedAvg", "hparams"] == "server.lr=30.0"
    run = next(s for s in expand(load_study(REPO / "configs" / "study_e_lr_grid.yaml"))
               if s.method == "DP-FedAvg" and s.hparams == {"server.lr": 30.0})
    cfg = load_config(REPO / "configs" / "canaries_study_e.yaml")
    ours, grids = json.loads(cfg.to_json()), json.loads(run.config.to_json())
    canaries = ours["privacy"].pop("canaries")
    assert grids["privacy"].pop("canaries") is None
    ours.pop("output_dir"), grids.pop("output_dir")
    assert ours == grids
    # the final model's score only (the every-round score is 2,000 dot products of 5,000,500 a round)
    assert canaries == {"count": 1000, "unused": 1000, "seed": 0, "confidence": 0.95, "every_round": False, "norm": 2.0}
