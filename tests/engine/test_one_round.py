"""One round, one orchestrator: ``fedprivacy run`` is the :class:`DPFedAvg` strategy plus a run's files, so a
hand-written Flower ServerApp with the same settings and the same ClientApp gives bit-identical models and
ledgers."""

import pytest
import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedprivacy.checkpoints import load_checkpoint
from fedprivacy.engines.cohorts import cohort_trainer
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.engines.processes import run_processes
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.records import model_to_record
from fedprivacy.fl.server_app import initial_model
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.privacy.mechanism import AdaptiveClipping
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

CASES = {
    "dp-fedavgm, poisson": ((), dict(optimizer="sgd", lr=1.0, optimizer_settings={"momentum": 0.9})),  # sgd: 0.9
    "dp-fedadam, fixed": (("server.optimizer=adam", "server.lr=0.05", "privacy.sampling=fixed", "privacy.accountants=[rdp]"),
                          dict(optimizer="adam", lr=0.05, sampling="fixed")),
    "adambc + disk + adaptive clip": (
        ("server.optimizer=adambc", "server.lr=0.01", "server.disk={kappa: 0.7, gamma: 0.5}",
         "privacy.adaptive_clipping={target_quantile: 0.5, learning_rate: 0.2}"),
        dict(optimizer="adambc", lr=0.01, disk_kappa=0.7, disk_gamma=0.5,
             adaptive_clipping=AdaptiveClipping(target_quantile=0.5, learning_rate=0.2, count_stddev=None))),
}


def _hand_written(cfg, strategy: DPFedAvg) -> DPFedAvg:
    """A stock Flower ServerApp around ``strategy`` against fedprivacy's ClientApp, on the run's engine."""
    task = load_task(cfg.data)
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        model = initial_model(task, cfg.seed, cfg.device)  # the run's x_0
        strategy.start(grid=grid, initial_arrays=model_to_record(model), num_rounds=cfg.rounds)

    run_inprocess(app, build_client_app(cfg), task.population, processes=run_processes(cfg),
                  cohort=cohort_trainer(cfg))
    return strategy


def run_and_hand_written(cfg, **keywords) -> tuple[DPFedAvg, dict]:
    """``fedprivacy run`` of ``cfg``, then the same strategy in keyword form (the config's noise multiplier, clip,
    cohort, population, seed and accountants, plus ``keywords``) in :func:`_hand_written`: that strategy and the
    run's checkpoint, for a bit-identity check."""
    run(cfg)
    saved = load_checkpoint(cfg.output_dir / "checkpoint.pt")
    p = cfg.privacy
    return _hand_written(cfg, DPFedAvg(
        noise_multiplier=p.noise_multiplier, clip_norm=p.clip_norm, expected_cohort=p.expected_cohort,
        population=load_task(cfg.data).population, seed=cfg.seed, accountants=tuple(p.accountants),
        **keywords)), saved


@pytest.mark.parametrize("case", list(CASES))
def test_fedprivacy_run_and_a_hand_written_server_app_are_bit_identical(small_config, tmp_path, case):
    overrides, settings = CASES[case]
    cfg = small_config("rounds=3", f"output_dir={tmp_path / 'run'}", *overrides)
    p = cfg.privacy
    if "adaptive_clipping" in settings:
        settings["adaptive_clipping"] = AdaptiveClipping(0.5, 0.2, p.count_stddev)
    strategy, saved = run_and_hand_written(cfg, **settings)
    assert torch.equal(strategy.params, saved["params"])
    assert strategy.mechanism.ledger.state_dict() == saved["ledger"]
    assert strategy.step.state_dict().keys() == {"optimizer", "disk"}
    assert strategy.round == saved["round"] == 3
