"""digits: the ServerApp, written as in Flower's quickstart with fedprivacy's DPFedAvg as the strategy."""

import logging
import time

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from digits.task import evaluate, majority_baseline, make_model, run_config, test_set
from fedprivacy import DPFedAvg, SecureAggregation

log = logging.getLogger("digits")
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = run_config(context)
    start = time.perf_counter()
    secagg = (SecureAggregation(cfg["secagg-threshold"], cfg["secagg-neighbours"], cfg["secagg-bits"])
              if cfg["secure-aggregation"] else None)
    strategy = DPFedAvg(noise_multiplier=cfg["noise-multiplier"], clip_norm=cfg["clip-norm"],
                        expected_cohort=cfg["expected-cohort"], population=cfg["num-users"],
                        placement=cfg["noise-placement"], optimizer=cfg["server-optimizer"], lr=cfg["server-lr"],
                        delta=cfg["delta"], seed=cfg["seed"], secure_aggregation=secagg,
                        accountants=("rdp",) if secagg else ("rdp", "pld"))
    x_test, y_test = test_set(cfg["seed"])

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = make_model(cfg["hidden"])
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, x_test, y_test)
        return MetricRecord({"test-loss": loss, "test-accuracy": accuracy, "epsilon": strategy.epsilons()["rdp"]})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_model(cfg["hidden"]).state_dict()),
                            num_rounds=cfg["num-server-rounds"], train_config=ConfigRecord(),
                            evaluate_fn=evaluate_fn)
    final = result.evaluate_metrics_serverapp[max(result.evaluate_metrics_serverapp)]
    eps = strategy.epsilons()
    print(f"digits: test accuracy {final['test-accuracy']:.3f} (majority baseline {majority_baseline(cfg['seed']):.3f})"
          f" after {cfg['num-server-rounds']} rounds of {cfg['expected-cohort']} of {cfg['num-users']} users;"
          f" epsilon {eps['rdp']:.2f} (RDP), {_pld(eps)} (PLD) at delta {cfg['delta']:g};"
          f" {time.perf_counter() - start:.1f} s", flush=True)


def _pld(eps: dict) -> str:
    """PLD's epsilon, or ``none`` (it does not model Skellam rounds: secure aggregation is accounted by RDP)."""
    return "none" if eps.get("pld") is None else f"{eps['pld']:.2f}"
