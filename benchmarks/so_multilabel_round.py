"""Seconds per round of the multi-label tag task at the papers' protocol, for every method of the study.

Workload (Reddi et al. 2021, arXiv:2003.00295v5, App. C, "SO LR"): logistic regression 10,000 -> 500 with a
sigmoid per tag (``data.task: tag_multilabel``, recall@5), 100 users per round (fixed-size sampling), one
local epoch, batch 100, client lr 10,000 (the task's loss is a mean over tags and posts), clip 1, noise for a
cohort of 1,000 among 342,477 users (``privacy.noise_cohort``, ``privacy.noise_population``; the correlated
mechanisms cannot emulate a larger cohort and run min-separated / cyclic participation over 50 groups with
their own noise instead; BandMF with 4 bands, at most the short run's horizon). Every method runs through
``fedprivacy.run.run`` (the in-process engine, its cohort trainer) in its own process; ``--rounds`` rounds
without evaluation or checkpoint, the first one warm-up, the median of the rest reported. Against it, interleaved in each of ``--repeat`` repeats:

* ``bare``: ``benchmarks/bare_loop.py`` on the same cohorts (no Flower, no fedprivacy objects: per user the
  closed-form sigmoid-BCE SGD on its rows, the exact clip, the sum; one Gaussian draw over 5,000,500
  coordinates, the server SGD step), torch on the run's ``num_threads``;
* ``floor``: what no implementation of the round can skip, measured on this machine: per client ONE
  ``embedding_bag`` forward and ONE sparse backward over all of its posts at once (no sequential steps:
  less work than local SGD), one pass over its ``(r_i, K)`` rows (gather, clip norm, sum), then the
  Gaussian draw and the server step, on one core (:func:`worker_floor`; two cores at best halve it).

Also measured once per repeat: the evaluation of the 10,000 test posts (``task.evaluate``) and a checkpoint
(``DP-FedAdam``'s run with ``checkpoint_every: 1`` minus without), and, with ``--breakdown``, where a
DP-FedAvg round's time goes (cProfile of a one-process run: local training, reply building, parsing,
clip and sum, noise, server step, broadcast record, metrics). The projection of 1,500 rounds adds the
evaluation every ``--eval-every`` rounds.

    python benchmarks/so_multilabel_round.py --data DIR [--rounds 8] [--repeat 2] [--methods ...]
        [--eval-every 125] [--breakdown] [--set key=value ...] [--out report.json]

``--data``: a StackOverflow-shaped folder (``fedprivacy data generate --out DIR --clients 5000``);
``--set``: extra config overrides for every fedprivacy run (e.g. another data source).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROUNDS_PROJECTED = 1500
INDEPENDENT = {"noise_cohort": 1000, "noise_population": 342477, "sampling": "fixed"}
CORRELATED = {"noise_cohort": None, "noise_population": None, "groups": 50}
METHODS: dict[str, dict] = {
    "DP-FedAvg": {"server": {"optimizer": "sgd", "momentum": 0.0, "lr": 1.0}},
    "DP-FedAvgM": {"server": {"optimizer": "sgd", "momentum": 0.9, "lr": 1.0}},
    "DP-FedAdam": {"server": {"optimizer": "adam", "lr": 0.1}},
    "DP-FedAdagrad": {"server": {"optimizer": "adagrad", "lr": 1.0}},
    "DP-FedAdamBC": {"server": {"optimizer": "adambc", "lr": 0.1}},
    "DP-MicroAdam": {"server": {"optimizer": "microadam", "lr": 0.1}},
    "AdaDPS": {"server": {"optimizer": "sgd", "momentum": 0.9, "lr": 1.0},
               "client": {"adadps": {"source": "top_words", "top_words": 100, "multiplier": 200}}},
    "DiSK": {"server": {"optimizer": "sgd", "momentum": 0.9, "lr": 1.0, "disk": {"kappa": 0.7, "gamma": 0.5}}},
    "tree": {"server": {"optimizer": "sgd", "momentum": 0.9, "lr": 1.0},
             "privacy": {**CORRELATED, "sampling": "min_separated", "mechanism": {"kind": "tree"}}},
    "BandMF": {"server": {"optimizer": "sgd", "momentum": 0.9, "lr": 1.0},
               "privacy": {**CORRELATED, "sampling": "cyclic_poisson", "mechanism": {"kind": "bandmf", "bands": 4}}},
    "BLT": {"server": {"optimizer": "sgd", "momentum": 0.9, "lr": 1.0},
            "privacy": {**CORRELATED, "sampling": "min_separated", "mechanism": {"kind": "blt", "buffers": 3}}},
}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config(method: str, data: Path, out: Path, rounds: int, sets: list[str], **top):
    """The run config of ``method`` (``--set`` overrides last)."""
    from fedprivacy.config import build_config

    base = {"rounds": rounds, "eval_every": 10**9, "checkpoint_every": 10**9, "output_dir": str(out),
            "data": {"path": str(data), "generate_if_missing": False, "task": "tag_multilabel",
                     "max_test_examples": 10_000},
            "client": {"epochs": 1, "batch_size": 100, "lr": 10_000.0},
            "privacy": {"clip_norm": 1.0, "expected_cohort": 100, "noise_multiplier": 1.0, "accountants": ["rdp"],
                        **INDEPENDENT}, **top}
    return build_config(_merge(base, METHODS[method]), sets)


def worker_engine(method: str, rounds: int, data: Path, sets: list[str], checkpoint_every: int) -> dict:
    """``rounds`` rounds of ``method`` (one more, not reported: a run evaluates after its last round)."""
    import pandas as pd

    from fedprivacy.run import run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(method, data, Path(tmp) / "run", rounds + 1, sets, checkpoint_every=checkpoint_every)
        run(cfg)
        seconds = pd.read_csv(Path(tmp) / "run" / "metrics.csv")["seconds"].tolist()[:-1]
    return {"round_seconds": seconds}


def _cohorts(cfg, task, rounds: int):
    from fedprivacy.privacy.sampling import make_sampler

    sampler = make_sampler(cfg.privacy.sampling, task.population, cfg.privacy.expected_cohort, cfg.seed)
    return [sampler.sample() for _ in range(rounds)]


def worker_bare(rounds: int, data: Path, sets: list[str]) -> dict:
    """The bare loop (benchmarks/bare_loop.py) on DP-FedAvg's cohorts and noise std."""
    sys.path.insert(0, str(HERE))
    import torch
    from bare_loop import bare_dp_fedavg

    from fedprivacy.stackoverflow_tasks import load_task

    cfg = config("DP-FedAvg", data, Path("unused"), rounds, sets)
    torch.set_num_threads(cfg.num_threads)
    task = load_task(cfg.data)
    p = cfg.privacy
    f = task.train.features
    _, seconds = bare_dp_fedavg(f.indptr, f.indices, f.data, None, task.partition.starts, task.partition.stops,
                                vocab=f.shape[1], classes=task.train.num_tags, rounds=rounds,
                                cohort=p.expected_cohort, client_lr=cfg.client.lr, clip=p.clip_norm,
                                z=p.noise_multiplier, seed=cfg.seed, cohorts=_cohorts(cfg, task, rounds),
                                tags=task.train.tags,
                                noise_std=p.noise_multiplier * p.clip_norm * p.expected_cohort / p.noise_cohort)
    return {"round_seconds": seconds}


def worker_floor(rounds: int, data: Path, sets: list[str]) -> dict:
    """The unavoidable work of a round (module docstring) on ONE core (two cores at best halve it; torch's
    intra-op threads on a shared 2-core machine measured up to 10x slower), and the evaluation's seconds.

    Per client (its rows, about 3 MB, stay in the cache: one matrix of the whole cohort's rows, 300 MB,
    measured slower), laid out as the cohort trainer does (untimed: data layout); timed: the gather of
    its rows, ONE forward over all its posts, the sigmoid-BCE logit gradient, ONE sparse backward into
    its rows, its norm and scaled sum into the dense total; then one Gaussian draw over every coordinate
    and the server step. Local SGD takes about ``posts / batch`` such steps in sequence: more work."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from fedprivacy.stackoverflow_tasks import load_task

    cfg = config("DP-FedAvg", data, Path("unused"), rounds, sets)
    torch.set_num_threads(1)
    task = load_task(cfg.data)
    k, vocab = task.train.num_tags, task.train.features.shape[1]
    params = torch.zeros(1 + vocab, k)
    total = torch.zeros_like(params)
    seconds, posts, rows = [], [], []
    for users in _cohorts(cfg, task, rounds):
        layouts = [_floor_layout(*task.client_data(int(u))) for u in users]
        posts.append(sum(len(layout[3]) for layout in layouts))
        rows.append(sum(len(layout[0]) for layout in layouts))
        t0 = time.perf_counter()
        total.zero_()
        for blocks, columns, values, offsets, row_of, at in layouts:
            x = params.index_select(0, blocks)
            logits = F.embedding_bag(columns, x, offsets, mode="sum", per_sample_weights=values) + params[0]
            g = torch.sigmoid(logits)
            g.index_put_(at, torch.tensor(-1.0), accumulate=True)
            xt = torch.sparse_coo_tensor(torch.stack([columns, row_of]), values, (len(x), len(offsets)),
                                         check_invariants=False)
            delta = torch.sparse.mm(xt, g)
            total.index_add_(0, blocks, delta, alpha=1.0 / max(1.0, float(delta.norm())))
        total.add_(torch.empty_like(total).normal_(0.0, 0.1))
        params.add_(total, alpha=1e-3)
        seconds.append(time.perf_counter() - t0)
    model = task.new_model()
    t0 = time.perf_counter()
    task.evaluate(model)
    return {"round_seconds": seconds, "evaluation_seconds": time.perf_counter() - t0,
            "posts_per_round": float(np.mean(posts)), "client_rows_per_round": float(np.mean(rows))}


def _floor_layout(features, tags):
    """One client's rows for :func:`worker_floor`: its blocks (its words' rows of the model), each stored
    value's row among them, the values, each post's first value, each value's post, the tags' (post, tag)."""
    import numpy as np
    import torch

    words, local = np.unique(features.indices, return_inverse=True)
    lengths = np.diff(features.indptr)
    return (torch.from_numpy(words.astype(np.int64) + 1), torch.from_numpy(local.astype(np.int64)),
            torch.from_numpy(features.data.astype(np.float32)),
            torch.from_numpy(features.indptr[:-1].astype(np.int64)),
            torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)),
            (torch.from_numpy(np.repeat(np.arange(tags.shape[0]), np.diff(tags.indptr))),
             torch.from_numpy(tags.indices.astype(np.int64))))


BREAKDOWN = {  # (file, function) -> part of the round
    "local training": [("sparse_cohort.py", "train_sparse_cohort")],
    "reply building (client_reply, update_to_record)": [("client_app.py", "client_reply")],
    "reply parsing (reply_to_update)": [("records.py", "reply_to_update")],
    "clip and sum (PrivateSum.add_)": [("aggregation.py", "add_")],
    "noise release (draw and add)": [("aggregation.py", "release")],
    "server step (post_process)": [("strategy.py", "post_process")],
    "broadcast record (layout_to_record)": [("records.py", "layout_to_record")],
    "privacy metrics (epsilon per round)": [("strategy.py", "_privacy_metrics")],
    "metrics row and log": [("run_hooks.py", "after_round")],
    "evaluation": [("stackoverflow_tasks.py", "evaluate")],
    "checkpoint": [("strategy_state.py", "save")],
}


def worker_breakdown(rounds: int, data: Path, sets: list[str]) -> dict:
    """cProfile of DP-FedAvg on one process (its cohort chunks in this thread), by part of the round, per round."""
    from fedprivacy.run import run

    with tempfile.TemporaryDirectory() as tmp:
        warm = config("DP-FedAvg", data, Path(tmp) / "warm", 1, [*sets, "processes=1"])
        run(warm)  # data loading, not profiled
        cfg = config("DP-FedAvg", data, Path(tmp) / "run", rounds, [*sets, "processes=1"])
        profile = cProfile.Profile()
        profile.runcall(run, cfg)
    stats = pstats.Stats(profile).stats
    cumulative = {}
    for (file, _, name), (_, _, _, cum, _) in stats.items():
        cumulative[(Path(file).name, name)] = cumulative.get((Path(file).name, name), 0.0) + cum
    rounds_s = cumulative.get(("strategy.py", "_round"), float("nan")) / rounds
    parts = {part: sum(cumulative.get(key, 0.0) for key in keys) / rounds for part, keys in BREAKDOWN.items()}
    return {"round_seconds_profiled": rounds_s, "per_round": parts,
            "note": "evaluation and checkpoint: once, after the last round (divided by the rounds)"}


def measure(kind: str, args, method: str = "", checkpoint_every: int = 10**9) -> dict:
    """One measurement in a fresh process; the median round (the first is warm-up) and the load after it."""
    cmd = [sys.executable, __file__, "--worker", kind, "--method", method or "DP-FedAvg", "--rounds",
           str(args.rounds), "--data", str(args.data), "--checkpoint-every", str(checkpoint_every),
           *[a for s in args.set for a in ("--set", s)]]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {method} failed:\n{out.stderr[-4000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if "round_seconds" in r:
        timed = r["round_seconds"][1:] or r["round_seconds"]
        r["seconds_per_round"] = statistics.median(timed)
    r["load_after"] = os.getloadavg()[0]
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="config override key=value (every fedprivacy run)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--eval-every", type=int, default=125)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-every", type=int, default=10**9, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        r = {"engine": lambda: worker_engine(args.method, args.rounds, args.data, args.set, args.checkpoint_every),
             "bare": lambda: worker_bare(args.rounds, args.data, args.set),
             "floor": lambda: worker_floor(args.rounds, args.data, args.set),
             "breakdown": lambda: worker_breakdown(args.rounds, args.data, args.set)}[args.worker]()
        print(json.dumps(r), flush=True)
        return 0

    runs: dict[str, list[float]] = {}
    loads, evaluations, checkpoints = [], [], []
    for _ in range(args.repeat):  # interleaved: a shared machine's load moves whole runs
        for kind in ("bare", "floor"):
            r = measure(kind, args)
            runs.setdefault(kind, []).append(r["seconds_per_round"])
            evaluations += [r["evaluation_seconds"]] if "evaluation_seconds" in r else []
            loads.append(r["load_after"])
            print(kind, json.dumps(r), flush=True)
        for method in args.methods:
            r = measure("engine", args, method)
            runs.setdefault(method, []).append(r["seconds_per_round"])
            loads.append(r["load_after"])
            print(method, json.dumps(r), flush=True)
        with_checkpoints = measure("engine", args, "DP-FedAdam", checkpoint_every=1)
        checkpoints.append(with_checkpoints["seconds_per_round"] - runs.get("DP-FedAdam", [float("nan")])[-1])
    evaluation = min(evaluations)
    report = {"machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
              "repeat": args.repeat, "load_after_each": loads, "evaluation_seconds": evaluation,
              "checkpoint_seconds_each_repeat": checkpoints, "methods": {}}
    for name, medians in runs.items():
        best = min(medians)
        report["methods"][name] = {
            "seconds_per_round_each_repeat": medians, "seconds_per_round": best,
            "over_bare": best / min(runs["bare"]),
            "projected_1500_rounds_minutes": (ROUNDS_PROJECTED * best
                                              + ROUNDS_PROJECTED // args.eval_every * evaluation) / 60}
    if args.breakdown:
        report["breakdown_dp_fedavg"] = measure("breakdown", args)
    text = json.dumps(report, indent=2)
    print(text)
    for name, m in report["methods"].items():
        print(f"{name:14s} {m['seconds_per_round']:6.3f} s/round  x{m['over_bare']:5.2f} bare  "
              f"1,500 rounds: {m['projected_1500_rounds_minutes']:5.1f} min  "
              f"(repeats {m['seconds_per_round_each_repeat']})")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
