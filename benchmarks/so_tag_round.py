"""Seconds per DP-FedAvg round: the in-process engine vs Flower's Simulation Engine (Ray), same apps.

Workload (issue "Speed", fixed so results compare over time): synthetic StackOverflow tag
prediction from our generator (default 1,000 users), logistic regression 10,000 -> 500
(5,000,500 parameters), exactly 100 clients per round (fixed-size sampling), 1 local epoch,
batch 100, clip + one dense noise draw + server SGD. Each engine runs ``--rounds`` rounds; the
first is warm-up, the median of the rest is reported, with the in-process/Ray ratio.

    python benchmarks/so_tag_round.py [--rounds 6] [--engines inprocess ray] [--clients 1000]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from fedprivacy.config import build_config
from fedprivacy.run import run


def bench(engine: str, rounds: int, clients: int, data: Path, out: Path) -> dict:
    cfg = build_config({
        "rounds": rounds, "eval_every": 10_000, "engine": engine, "output_dir": str(out / engine),
        "data": {"path": str(data), "synthetic_clients": clients},
        "client": {"epochs": 1, "batch_size": 100, "lr": 30.0},
        "server": {"lr": 1.0, "momentum": 0.0},
        "privacy": {"sampling": "fixed", "expected_cohort": 100, "accountants": ["rdp"], "noise_multiplier": 1.0},
    })
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    seconds = pd.read_csv(out / engine / "metrics.csv")["seconds"].tolist()
    per_round = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    return {"engine": engine, "seconds_per_round": per_round, "client_updates_per_s": 100 / per_round,
            "rounds_timed": len(seconds) - 1, "wall_s_including_startup": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--engines", nargs="+", default=["inprocess", "ray"])
    ap.add_argument("--data", type=Path, default=Path("data/synthetic"))
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            results.append(bench(engine, args.rounds, args.clients, args.data, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    by = {r["engine"]: r for r in results}
    report = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
                         f"{__import__('os').cpu_count()} cores", "torch": torch.__version__,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "results": results}
    if "inprocess" in by and "ray" in by:
        report["ray_over_inprocess"] = by["ray"]["seconds_per_round"] / by["inprocess"]["seconds_per_round"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
