"""Seconds per round of the QUICKSTART's own setting: in-process vs the bare loop, one client at a time.

Workload: exactly ``configs/quickstart.yaml`` (the embedded default): synthetic StackOverflow tag
prediction (``data/synthetic``, 1,000 users, 397 posts on average), logistic regression 10,000 -> 500,
Poisson sampling of expected cohort 100, 5 local epochs of batch 10 at client lr 30 (about 200
local steps per client), clip C = 10, z = 1, server SGD lr 1 with momentum 0.9; except that the
model is evaluated and checkpointed only after the last round (as in ``so_tag_round.py``), so a
round is the federated work alone. Each measurement runs in its own process and ``--rounds`` rounds
(+ 1 unreported, evaluated); the first is warm-up, the median of the rest is reported.

Measured, interleaved, ``--repeat`` times (a shared machine's load moves whole runs, so the goal
reads the median of the PAIRED ratios, each pair measured back to back):

- ``bare``: ``benchmarks/bare_loop.py``'s one-client-at-a-time loop with the quickstart's epochs,
  batch and lr, on the very cohorts the in-process run samples (its sampler, its seed), torch 1
  thread: the limit of training the clients one after another;
- ``inprocess_1``: ``fedprivacy`` in-process, ``processes: 1`` (one core; the tag task's clients
  trained together, :mod:`fedprivacy.client.sparse_cohort`). Goal: ``inprocess_1 / bare <= 0.8``;
- ``inprocess``: the default, ``processes: null`` (every usable core: the cohort's chunks on that many threads);
- ``alone_1``: ``cohort_batching: off``, ``processes: 1``, the engine as it was before (clients one
  at a time; no goal, for reference);
- with ``--chunks N ...``: ``inprocess_1`` with ``SPARSE_CHUNK_EXAMPLES = N`` (no goal: the chunk size's choice).

    python benchmarks/quickstart_round.py [--rounds 6] [--repeat 3] [--chunks 500 2000 8000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from so_tag_round import finish, measure, worker_engine  # noqa: E402

GOAL = 0.8  # inprocess_1 / bare, at most


def _config(engine: str, rounds: int, data: Path, out: Path, cohort: int, clients: int, processes: int | None = None,
            batching: str = "auto"):
    """The quickstart's config, evaluated and checkpointed only after the last round."""
    from fedprivacy.config import build_config

    return build_config({"rounds": rounds, "eval_every": 10**9, "checkpoint_every": 10**9, "output_dir": str(out),
                         "processes": processes, "cohort_batching": batching,
                         "data": {"path": str(data), "synthetic_clients": clients}})


def worker(kind: str, rounds: int, data: Path, clients: int) -> dict:
    """One measurement in this process: ``kind`` as in the module docstring (``inprocess_1_chunkN``: chunk N)."""
    if kind == "bare":
        return worker_bare(rounds, data, clients)
    if "_chunk" in kind:
        from fedprivacy.engines import cohorts

        cohorts.SPARSE_CHUNK_EXAMPLES = int(kind.rsplit("_chunk", 1)[1])
    processes = None if kind == "inprocess" else 1
    batching = "off" if kind == "alone_1" else "auto"
    r = worker_engine("inprocess", rounds, data, 100, clients, processes,
                      make_config=lambda *a: _config(*a[:6], processes=processes, batching=batching))
    r["engine"] = kind
    return r


def worker_bare(rounds: int, data: Path, clients: int) -> dict:
    """The bare loop with the quickstart's local training, on the in-process run's cohorts (loading not timed)."""
    import torch
    from bare_loop import bare_dp_fedavg

    from fedprivacy.privacy.sampling import make_sampler
    from fedprivacy.stackoverflow_tasks import ensure_data, load_task

    cfg = _config("inprocess", rounds, data, Path("unused"), 100, clients)
    torch.set_num_threads(1)
    ensure_data(cfg.data)
    task = load_task(cfg.data)
    f = task.train.features
    p, c = cfg.privacy, cfg.client
    sampler = make_sampler(p.sampling, task.population, p.expected_cohort, cfg.seed)
    cohorts = [sampler.sample() for _ in range(rounds)]
    _, seconds = bare_dp_fedavg(f.indptr, f.indices, f.data, task.train.labels, task.partition.starts,
                                task.partition.stops, vocab=f.shape[1], classes=task.train.num_tags, rounds=rounds,
                                cohort=p.expected_cohort, batch_size=c.batch_size, epochs=c.epochs, client_lr=c.lr,
                                clip=p.clip_norm, z=p.noise_multiplier, seed=cfg.seed, cohorts=cohorts)
    return {"engine": "bare", "population": task.population, "round_seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data", type=Path, default=Path("data/synthetic"))
    ap.add_argument("--clients", type=int, default=1000, help="users to generate in --data if it is missing")
    ap.add_argument("--chunks", type=int, nargs="*", default=[], help="also inprocess_1 at these chunk sizes")
    ap.add_argument("--out", type=Path, help="also write the report (JSON) here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cohort", type=int, default=100, help=argparse.SUPPRESS)
    ap.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        r = worker(args.worker, args.rounds, args.data, args.clients)
        print(json.dumps(r), flush=True)
        return 0

    import torch

    kinds = ["bare", "inprocess_1", "inprocess", "alone_1", *(f"inprocess_1_chunk{n}" for n in args.chunks)]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    pairs: dict[str, list[float]] = {k: [] for k in kinds if k != "bare"}
    for _ in range(args.repeat):
        for kind in kinds:
            r = measure(kind, args.rounds, args.data, clients=args.clients, script=__file__)
            print(json.dumps(r), flush=True)
            runs[kind].append(r)
            if kind != "bare":  # paired with this repeat's bare run
                pairs[kind].append(r["seconds_per_round"] / runs["bare"][-1]["seconds_per_round"])
    ratios = {f"{k}_over_bare": statistics.median(v) for k, v in pairs.items()}
    ratios |= {f"{k}_over_bare_each_repeat": v for k, v in pairs.items()}
    ratios |= {f"{k}_seconds_per_round_each_repeat": [r["seconds_per_round"] for r in v] for k, v in runs.items()}
    ratios["load_after_each_measurement"] = {k: [r["load_after"] for r in v] for k, v in runs.items()}
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": runs, "ratios": ratios,
              "goals": {"inprocess_1_over_bare": {"met": ratios["inprocess_1_over_bare"] <= GOAL, "target": GOAL}}}
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
