"""digit_writers: the ServerApp, Flower's quickstart with fedprivacy's DPFedAvg over the writers (one partition
each) and the task's test records for evaluation."""

import time

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from digit_writers.task import load_task, run_config
from fedprivacy import DPFedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = run_config(context)
    start = time.perf_counter()
    task = load_task(cfg["data-dir"], cfg["seed"])
    strategy = DPFedAvg(noise_multiplier=cfg["noise-multiplier"], clip_norm=cfg["clip-norm"],
                        expected_cohort=cfg["expected-cohort"], population=task.population,
                        placement=cfg["noise-placement"], optimizer=cfg["server-optimizer"], lr=cfg["server-lr"],
                        delta=cfg["delta"], seed=cfg["seed"])

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = task.new_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        metrics = task.evaluate(model)
        return MetricRecord({"test-loss": metrics["test_loss"], "test-accuracy": metrics["test_accuracy"],
                             "epsilon": strategy.epsilons()["rdp"]})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(task.new_model().state_dict()),
                            num_rounds=cfg["num-server-rounds"], train_config=ConfigRecord(), evaluate_fn=evaluate_fn)
    final = result.evaluate_metrics_serverapp[max(result.evaluate_metrics_serverapp)]
    eps = strategy.epsilons()
    print(f"digit writers: test accuracy {final['test-accuracy']:.3f} (majority baseline {task.majority_baseline:.3f})"
          f" after {cfg['num-server-rounds']} rounds of {cfg['expected-cohort']} of {task.population} writers;"
          f" epsilon {eps['rdp']:.2f} (RDP), {eps['pld']:.2f} (PLD) at delta {cfg['delta']:g};"
          f" {time.perf_counter() - start:.1f} s", flush=True)
