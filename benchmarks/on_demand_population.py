"""The on-demand synthetic population (``data.source: synthetic``): generation cost and a run's footprint.

Two measurements, printed as JSON lines:

* ``generation``: ms per train user of the fast path (draws -> tag rows, one client's
  ``FederatedTagData``; mean ~400 posts), with the words and tags drawn through the guide tables
  (``guided``) and through ``np.searchsorted`` (``searchsorted``, the former code), interleaved A/B,
  ``--repeats`` times over the same ``--users`` users;
* ``run``: peak RSS (the run's own process, ``ru_maxrss``) and the disk the run leaves (its data
  folder and output folder) of a short run, 3 rounds, cohort 100, ``tag_multilabel``, 1 epoch of
  batch 100, at populations 10,000 and 342,477, interleaved, each in a fresh process; the count
  files (shared by both populations: both count the first 10,000 train users) are written before
  the measured runs. Then the ratio 342,477 / 10,000 of the medians. Before each run, the data
  layer alone in a fresh process: ``load_task`` (its 10,000-post test set) and 300 clients' rows,
  its peak RSS.

With ``--base REV``, instead: ``client_data`` CPU time per user (``time.process_time``, so the other jobs on a
shared machine count less) of this tree against revision ``REV`` (its ``fedprivacy`` package unpacked by
``git archive``), ``--users`` random clients of the 342,477-user study population (``configs/study_e_lr_grid.yaml``'s
data section), each revision in a fresh process, the order alternating between repeats; the users' rows are hashed
and must be equal.

Run from the repository root: ``python benchmarks/on_demand_population.py [--repeats 2]``, or
``python benchmarks/on_demand_population.py --base 0c74c33 --users 500 --repeats 6``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

POPULATIONS = (10_000, 342_477)


def _disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _config(folder: Path, population: int):
    from fedprivacy.config import build_config

    return build_config({
        "rounds": 3, "eval_every": 3, "output_dir": str(folder / f"run-{population}-{time.time_ns()}"), "processes": 1,
        "data": {"path": str(folder / "data"), "source": "synthetic", "synthetic_clients": population,
                 "task": "tag_multilabel", "max_test_examples": 10_000},
        "client": {"epochs": 1, "batch_size": 100, "lr": 30.0},
        "privacy": {"clip_norm": 10.0, "noise_multiplier": 1.0, "expected_cohort": 100, "accountants": ["rdp"]}})


def run_once(folder: Path, population: int) -> dict:
    """One short run in this process; its peak RSS, wall time, round seconds and the disk it leaves."""
    import pandas as pd

    from fedprivacy.run import run

    cfg = _config(folder, population)
    started = time.perf_counter()
    run(cfg)
    return {"population": population,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "wall_s": round(time.perf_counter() - started, 1),
            "round_s": [round(x, 2) for x in pd.read_csv(cfg.output_dir / "metrics.csv")["seconds"]],
            "disk_mb": round((_disk(cfg.data.path) + _disk(cfg.output_dir)) / 2 ** 20, 2)}


def data_layer(folder: Path, population: int) -> dict:
    """The data layer alone in this process: the task (its 10,000-post test set) and 300 clients' rows."""
    from fedprivacy.stackoverflow_tasks import load_task

    task = load_task(_config(folder, population).data)
    for i in range(300):
        task.client_data(i * (task.population // 300))
    return {"population": population, "data_layer_peak_rss_mb":
            round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def generation(users: int, repeats: int) -> dict:
    """ms per user of the fast path, guide table vs searchsorted, interleaved."""
    from fedprivacy.config import build_config
    from fedprivacy.data import synthetic
    from fedprivacy.stackoverflow_tasks import on_demand_rows

    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config({"data": {"path": tmp, "source": "synthetic", "synthetic_clients": users,
                                     "task": "tag_multilabel", "max_test_examples": 10}}).data
        tags = on_demand_rows(cfg)
    guided_call = synthetic._GuidedCDF.__call__

    def searchsorted(self, uniforms):
        return np.searchsorted(self.cdf[:-1], uniforms, side="right")

    times: dict[str, list[float]] = {"guided": [], "searchsorted": []}
    posts = 0
    for _ in range(repeats):
        for name, call in (("guided", guided_call), ("searchsorted", searchsorted)):
            synthetic._GuidedCDF.__call__ = call
            started = time.perf_counter()
            posts = sum(int(tags.client(i).offsets[-1]) for i in range(users))
            times[name].append((time.perf_counter() - started) / users * 1e3)
    synthetic._GuidedCDF.__call__ = guided_call
    return {"measure": "generation", "users": users, "mean_posts": posts / users,
            **{f"{k}_ms_per_user": [round(t, 3) for t in v] for k, v in times.items()}}


def study_clients(folder: Path, users: int) -> dict:
    """CPU ms per user of ``client_data`` for ``users`` random clients of the study's population, and their rows' hash."""
    from fedprivacy.config import build_config
    from fedprivacy.stackoverflow_tasks import load_task

    task = load_task(build_config({"data": {"path": str(folder), "source": "synthetic", "synthetic_clients": 342_477,
                                            "task": "tag_multilabel", "max_test_examples": 10}}).data)
    clients = np.random.default_rng(0).integers(task.population, size=users).tolist()
    digest = hashlib.sha256()
    started = time.process_time()
    data = [task.client_data(c) for c in clients]
    seconds = time.process_time() - started
    for x, y in data:
        for array in (x.indptr, x.indices, x.data, *((y.indptr, y.indices, y.data) if hasattr(y, "indptr") else (y,))):
            digest.update(np.ascontiguousarray(array).tobytes())
    return {"cpu_ms_per_user": round(seconds / users * 1e3, 3), "rows_sha256": digest.hexdigest()[:16]}


def against_base(base: str, users: int, repeats: int) -> None:
    """This tree's ``client_data`` against revision ``base``'s, fresh processes, order alternating; prints JSON lines."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"current": Path.cwd(), base: Path(tmp) / "base"}
        trees[base].mkdir()
        archive = subprocess.run(["git", "archive", base, "fedprivacy"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(trees[base])], input=archive, check=True)
        data = Path(tmp) / "data"

        def child(name: str) -> dict:
            env = {**os.environ, "PYTHONPATH": str(trees[name])}
            out = subprocess.run([sys.executable, __file__, "--child", "clients", str(data), str(users)], env=env,
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            return {"revision": name, **json.loads(out)}

        child("current")   # writes the count files (shared: same generator arguments), warms the file cache
        times: dict[str, list[float]] = {name: [] for name in trees}
        hashes = set()
        for repeat in range(repeats):
            for name in (list(trees) if repeat % 2 == 0 else list(trees)[::-1]):
                result = child(name)
                print(json.dumps(result), flush=True)
                times[name].append(result["cpu_ms_per_user"])
                hashes.add(result["rows_sha256"])
        if len(hashes) != 1:
            raise SystemExit(f"the revisions' rows differ: {sorted(hashes)}")
        ratios = [b / c for b, c in zip(times[base], times["current"])]
        print(json.dumps({"measure": f"client_data cpu ms/user, {base} / current", "users": users,
                          "median_ratio": round(float(np.median(ratios)), 2),
                          "ratios": [round(r, 2) for r in ratios],
                          **{f"{k}_median_ms": round(float(np.median(v)), 3) for k, v in times.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--users", type=int, default=300)
    parser.add_argument("--generation-only", action="store_true", help="skip the runs")
    parser.add_argument("--base", metavar="REV", help="compare client_data's CPU time with this revision's")
    parser.add_argument("--child", nargs=3, metavar=("WHAT", "FOLDER", "POPULATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, folder, number = args.child
        measure = {"run": run_once, "data": data_layer, "clients": study_clients}[what]
        print(json.dumps(measure(Path(folder), int(number))))
        return
    if args.base:
        against_base(args.base, args.users, args.repeats)
        return
    print(json.dumps(generation(args.users, args.repeats)), flush=True)
    if args.generation_only:
        return
    with tempfile.TemporaryDirectory() as tmp:
        from fedprivacy.stackoverflow_tasks import ensure_data

        started = time.perf_counter()
        ensure_data(_config(Path(tmp), POPULATIONS[-1]).data)    # the count files, once (shared)
        print(json.dumps({"measure": "count_files", "seconds": round(time.perf_counter() - started, 1)}), flush=True)
        results: dict[int, list[dict]] = {p: [] for p in POPULATIONS}
        for _ in range(args.repeats):
            for population in POPULATIONS:
                for what in ("data", "run"):
                    out = subprocess.run([sys.executable, __file__, "--child", what, tmp, str(population)], check=True,
                                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
                    print(out, flush=True)
                results[population].append(json.loads(out))
    small, large = ({k: float(np.median([r[k] for r in results[p]])) for k in ("peak_rss_mb", "disk_mb", "wall_s")}
                    for p in POPULATIONS)
    print(json.dumps({"measure": "ratio 342477/10000 (medians)",
                      **{k: round(large[k] / small[k], 3) for k in small}}))


if __name__ == "__main__":
    main()
