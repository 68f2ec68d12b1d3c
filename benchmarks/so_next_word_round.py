"""Seconds per DP-FedAvg round on next-word prediction: in-process vs Ray, pfl-research, bare loop.

Workload: synthetic StackOverflow next-word prediction from our generator (``data.task=next_word``,
``--clients`` users, at most 256 posts each: ``data.max_examples_per_client=256``), TFF's LSTM
(4,053,428 parameters: TFF's 4,050,748 plus PyTorch's second LSTM bias), Reddi et al.'s client
settings (1 local epoch, batch 16; arXiv:2003.00295, App. C), exactly ``--cohort`` clients per round
(fixed-size sampling), client lr 0.5, DP-FedAvg (clip C = 1, one dense Gaussian draw z = 1, fixed
divisor = the cohort, server SGD lr 1 without momentum). Checkpoint and evaluation only after the
last round (that round is run but not reported). Every measurement runs in its own process; each
runs ``--rounds`` rounds, the first is warm-up, the median of the rest is reported.

Compared, in one run, with ratios against the bare loop and against Ray (exit status 1 if a goal is missed):

1. Flower's Simulation Engine (Ray), the same ServerApp and ClientApp: goal in-process >= 10x faster;
2. pfl-research 0.6 (``benchmarks/pfl_next_word.py`` in the venv ``benchmarks/.venv-pfl``, created
   here on first use): goal >= 2x faster;
3. a bare PyTorch loop of the same math on the same users (``benchmarks/bare_next_word.py``): goal
   in-process within 1.25x. The bare loop's own ratio to Ray is printed too: where it is far below
   10, no implementation of this math can reach the Ray goal on this machine (the LSTM's compute,
   not the framework, is the round).

    python benchmarks/so_next_word_round.py [--rounds 3] [--cohort 100] [--clients 1000]
        [--only inprocess bare pfl ray] [--repeat 2] [--processes N] [--data data/synthetic]

A full run takes ~50 min on this quiet 2-core machine with the TFF-shaped data a fresh clone generates
(one next-word round of 100 clients at the 256-sentence cap is ~40 s on 2 processes, ~70 s on one);
``--rounds 2 --cohort 30 --repeat 1`` keeps it near 10 min (``--cohort``: clients per round;
``--clients``: the population generated in ``--data`` if missing).

The in-process engine runs on ``--processes`` processes (default: the machine's cores), Ray on one
client per core; the bare loop and pfl on one thread (torch 1 thread), as fedprivacy's default.
``inprocess_1`` (one process) is measured too when ``--processes`` > 1: it is the like-for-like
comparison with the one-thread bare loop and pfl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import so_tag_round  # noqa: E402  (one pfl venv, one measurement and report for both benchmarks)
from so_tag_round import PFL_VENV, _peak_rss_mb  # noqa: E402

GOALS = {"ray": 10.0, "pfl": 2.0, "bare": 1 / 1.25}
MAX_POSTS = 256  # Reddi et al.: at most 256 sentences per client
CLIENT_LR, CLIP, Z = 0.5, 1.0, 1.0


def _config(engine: str, rounds: int, data: Path, out: Path, cohort: int, clients: int, processes: int = 1):
    from fedprivacy.config import build_config

    return build_config({
        "processes": processes if engine == "inprocess" else 1,
        "rounds": rounds, "eval_every": 10**9, "checkpoint_every": 10**9, "engine": engine, "output_dir": str(out),
        "data": {"path": str(data), "synthetic_clients": clients, "task": "next_word",
                 "max_examples_per_client": MAX_POSTS},
        "client": {"epochs": 1, "batch_size": 16, "lr": CLIENT_LR},
        "server": {"lr": 1.0, "momentum": 0.0},
        "privacy": {"sampling": "fixed", "expected_cohort": cohort, "accountants": ["rdp"], "noise_multiplier": Z,
                    "clip_norm": CLIP},
    })


def worker_engine(engine: str, rounds: int, data: Path, cohort: int, clients: int, processes: int) -> dict:
    """One fedprivacy engine in this process on this workload (:func:`so_tag_round.worker_engine`)."""
    return so_tag_round.worker_engine(engine, rounds, data, cohort, clients, processes, make_config=_config)


def _load(rounds: int, data: Path, cohort: int, clients: int):
    from fedprivacy.stackoverflow_tasks import ensure_data, load_task

    cfg = _config("inprocess", rounds, data, Path("unused"), cohort, clients)
    ensure_data(cfg.data)
    return cfg, load_task(cfg.data)


def worker_bare(rounds: int, data: Path, cohort: int, clients: int, processes: int) -> dict:
    """The bare loop on the in-process run's very cohorts (its sampler, its seed); loading is not timed."""
    import torch
    from bare_next_word import bare_next_word_dp_fedavg

    from fedprivacy.privacy.sampling import make_sampler

    cfg, task = _load(rounds, data, cohort, clients)
    torch.set_num_threads(cfg.num_threads)
    sampler = make_sampler(cfg.privacy.sampling, task.population, cfg.privacy.expected_cohort, cfg.seed)
    cohorts = [sampler.sample() for _ in range(rounds)]
    torch.manual_seed(cfg.seed)
    seconds = bare_next_word_dp_fedavg(task.new_model(), task.train.tokens, task.partition.starts,
                                       task.partition.stops, cohorts=cohorts, client_lr=CLIENT_LR, clip=CLIP, z=Z,
                                       seed=cfg.seed)
    return {"engine": "bare", "population": task.population, "round_seconds": seconds}


def worker_pfl(rounds: int, data: Path, cohort: int, clients: int, processes: int) -> dict:
    """Export the users' token rows, then run ``pfl_next_word.py`` in pfl's own venv."""
    import numpy as np

    from fedprivacy.data.next_word import special_tokens

    if not (PFL_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(PFL_VENV)], check=True)
        subprocess.run([str(PFL_VENV / "bin" / "pip"), "install", "-q", "pfl==0.6.*", "torch==2.13.0"], check=True)
    _, task = _load(rounds, data, cohort, clients)
    part = task.partition
    with tempfile.TemporaryDirectory() as tmp:
        rows = [np.asarray(task.train.tokens[a:b]) for a, b in zip(part.starts, part.stops)]
        counts = np.array([len(r) for r in rows])
        np.savez(Path(tmp) / "tokens.npz", tokens=np.concatenate(rows), offsets=np.concatenate([[0], np.cumsum(counts)]))
        out = subprocess.run([str(PFL_VENV / "bin" / "python"), str(HERE / "pfl_next_word.py"), "--data", tmp,
                              "--rounds", str(rounds), "--cohort", str(cohort), "--clip", str(CLIP), "--z", str(Z),
                              "--client-lr", str(CLIENT_LR),
                              "--classes", str(special_tokens(task.train.vocab_size).num_classes)],
                             capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"pfl_next_word.py failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["population"] = task.population
    return result


def measure(kind: str, rounds: int, data: Path, cohort: int, clients: int, processes: int) -> dict:
    """One measurement of this workload in a fresh process (:func:`so_tag_round.measure`)."""
    return so_tag_round.measure(kind, rounds, data, cohort, clients, processes, script=__file__)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per measurement (the first is warm-up)")
    ap.add_argument("--cohort", type=int, default=100, help="clients per round")
    ap.add_argument("--clients", type=int, default=1000, help="users to generate in --data if it is missing")
    ap.add_argument("--only", nargs="+", default=["inprocess", "bare", "pfl", "ray"])
    ap.add_argument("--data", type=Path, default=Path("data/synthetic"))
    ap.add_argument("--processes", type=int, default=os.cpu_count(),
                    help="in-process engine: processes running ClientApps (default: the machine's cores)")
    ap.add_argument("--repeat", type=int, default=2,
                    help="measure in-process, bare and pfl this many times, interleaved; keep each one's fastest")
    ap.add_argument("--out", type=Path, help="also write the report (JSON) here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        fn = {"bare": worker_bare, "pfl": worker_pfl}.get(args.worker)
        r = (fn(args.rounds, args.data, args.cohort, args.clients, args.processes) if fn
             else worker_engine(args.worker.removesuffix("_1"), args.rounds, args.data, args.cohort, args.clients,
                                1 if args.worker.endswith("_1") else args.processes))
        r.setdefault("peak_rss_mb", _peak_rss_mb())
        print(json.dumps(r), flush=True)
        return 0

    import torch

    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    kinds = [k for k in ("inprocess", "inprocess_1", "bare", "pfl", "ray")
             if k.removesuffix("_1") in args.only and not (k == "inprocess_1" and args.processes == 1)]
    for rep in range(args.repeat):  # interleaved; the fastest of each kind's medians is kept (shared machine)
        for kind in kinds:
            if kind == "ray" and rep:
                continue  # Ray's start-up alone takes tens of seconds; measured once
            r = measure(kind, args.rounds, args.data, args.cohort, args.clients, args.processes)
            print(json.dumps(r), flush=True)
            medians = results.get(kind, {}).get("medians_of_repeats", []) + [r["seconds_per_round"]]
            if kind not in results or r["seconds_per_round"] < results[kind]["seconds_per_round"]:
                results[kind] = r
            results[kind]["medians_of_repeats"] = medians
    ratios, goals = {}, {}
    base = results.get("inprocess")
    for kind in ("ray", "pfl", "bare", "inprocess_1"):
        if base and kind in results:
            ratios[f"{kind}_over_inprocess"] = results[kind]["seconds_per_round"] / base["seconds_per_round"]
            if kind in GOALS:
                goals[kind] = ratios[f"{kind}_over_inprocess"] >= GOALS[kind]
    if "ray" in results:  # what ANY implementation of this math could gain over Ray here
        for kind in ("bare", "pfl", "inprocess_1"):
            if kind in results:
                ratios[f"ray_over_{kind}"] = results["ray"]["seconds_per_round"] / results[kind]["seconds_per_round"]
    if "bare" in results and "inprocess_1" in results:
        ratios["inprocess_1_over_bare"] = results["inprocess_1"]["seconds_per_round"] / results["bare"]["seconds_per_round"]
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other agents)",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(sys.argv), "load_before": load_before, "load_after": os.getloadavg(),
              "results": results, "ratios": ratios,
              "goals": {k: {"met": v, "target": GOALS[k]} for k, v in goals.items()}}
    return so_tag_round.finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
