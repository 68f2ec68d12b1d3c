"""Data loading: cold preprocessing vs cached (memory-mapped) load, and full-split throughput.

Each measurement runs in a fresh Python process, timing only the call (imports excluded):

* ``build``: ``load_task`` of the AdaDPS view (first ``--subset`` training users, 80/20 by
  position) with an empty cache folder: reads the example file, tokenizes, writes the cache;
* ``hit``: the same call again (``--repeats`` fresh processes, median): a cache hit, nothing
  parsed or tokenized;
* ``full``: preprocessing of the whole train split for tag prediction, cache disabled:
  examples per second and the process's peak RSS (``ru_maxrss``), to show memory stays bounded
  as the file grows (run with two ``--clients`` values).

``--scaling C1 C2 ...`` instead measures, for each number of training users (generated under
``--workdir`` if missing), cold preprocessing of the whole train split for tag prediction in a
fresh process, twice: ``stream`` writes the cache entry client by client into an empty cache
folder (what ``prepared_tags`` does with a cache), ``memory`` builds the arrays in memory (cache
disabled). Each prints examples/s and the peak RSS, so that memory staying flat for ``stream``
and growing for ``memory`` is visible (e.g. ``--scaling 12000 50000``: ~0.5M and ~2.1M posts).

Usage: ``python benchmarks/data_loading.py [--clients 1000] [--subset 400]
[--format tff-sqlite|tff-h5] [--workdir /tmp/fedprivacy-bench-data] [--repeats 5] [--no-full]``
or ``python benchmarks/data_loading.py --scaling 12000 50000 [--format F] [--workdir W]``
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _child(mode: str, path: Path, fmt: str, subset: int, cache: Path) -> dict:
    from fedprivacy.config import DataConfig
    from fedprivacy.data.prepared import prepared_tags
    from fedprivacy.data.sources import open_source
    from fedprivacy.stackoverflow_tasks import load_task

    if mode in ("full", "memory", "stream"):
        source = open_source(fmt, path)
        root = cache if mode == "stream" else None  # stream: a cache folder, emptied by the parent
        start = time.perf_counter()
        data, status = prepared_tags(source, "train", vocab_size=10_000, num_tags=500,
                                     no_tag="label0", cache_root=root)
        seconds = time.perf_counter() - start
        assert status == ("built" if mode == "stream" else "disabled"), status
        return {"examples": int(data.offsets[-1]), "seconds": seconds,
                "examples_per_s": data.offsets[-1] / seconds,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    cfg = DataConfig(path=path, source=fmt, view="adadps", max_clients=subset,
                     generate_if_missing=False, cache_dir=cache)
    start = time.perf_counter()
    task = load_task(cfg)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "population": task.population,
            "train_examples": int(task.partition.sizes.sum()), "test_examples": len(task.test_labels)}


def _run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _dir_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def _scaling(args: argparse.Namespace) -> None:
    from fedprivacy.data.synthetic import generate

    rows = []
    for clients in args.scaling:
        data = args.workdir / f"{args.format}-{clients}"
        if not data.exists():
            start = time.perf_counter()
            generate(data, num_clients=clients, seed=0, format=args.format)
            print(f"generated {clients} users in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr)
        cache = args.workdir / f"cache-stream-{args.format}-{clients}"
        for mode in ("stream", "memory"):
            shutil.rmtree(cache, ignore_errors=True)
            out = _run_child(mode, str(data), args.format, "0", str(cache))
            row = {"mode": mode, "clients": clients, "examples": out["examples"],
                   "seconds": round(out["seconds"], 1),
                   "examples_per_s": round(out["examples_per_s"]),
                   "peak_rss_mb": round(out["peak_rss_mb"])}
            if mode == "stream":
                row["cache_entry_mb"] = round(_dir_mb(cache))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps({"format": args.format, "runs": rows}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--subset", type=int, default=400)
    parser.add_argument("--format", choices=["tff-sqlite", "tff-h5"], default="tff-sqlite")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/fedprivacy-bench-data"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-full", action="store_true", help="skip the full-split throughput run")
    parser.add_argument("--scaling", type=int, nargs="+", metavar="CLIENTS",
                        help="only measure full-split preprocessing (streamed cache vs in "
                             "memory) at these numbers of training users")
    parser.add_argument("--child", nargs=5, metavar=("MODE", "PATH", "FORMAT", "SUBSET", "CACHE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path, fmt, subset, cache = args.child
        print(json.dumps(_child(mode, Path(path), fmt, int(subset), Path(cache))))
        return
    if args.scaling:
        _scaling(args)
        return

    from fedprivacy.data.synthetic import generate

    data = args.workdir / f"{args.format}-{args.clients}"
    if not data.exists():
        start = time.perf_counter()
        generate(data, num_clients=args.clients, seed=0, format=args.format)
        print(f"generated {args.clients} users in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    cache = args.workdir / f"cache-{args.format}-{args.clients}"
    shutil.rmtree(cache, ignore_errors=True)
    common = (str(data), args.format, str(args.subset), str(cache))
    build = _run_child("build", *common)
    hits = [_run_child("hit", *common)["seconds"] for _ in range(args.repeats)]
    result = {"format": args.format, "clients": args.clients, "subset": args.subset,
              "population": build["population"], "train_examples": build["train_examples"],
              "test_examples": build["test_examples"], "cold_load_s": round(build["seconds"], 3),
              "cached_load_s_median": round(statistics.median(hits), 4),
              "cached_load_s_max": round(max(hits), 4)}
    if not args.no_full:
        full = _run_child("full", *common)
        result |= {"full_train_examples": full["examples"],
                   "full_preprocess_examples_per_s": round(full["examples_per_s"]),
                   "full_preprocess_peak_rss_mb": round(full["peak_rss_mb"])}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
