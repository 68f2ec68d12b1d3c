"""The quickstart's first minute: ``fedprivacy run`` with no config from a clean start, data generation included.

Each measurement runs ``python -m fedprivacy run`` (the embedded default, ``configs/quickstart.yaml``) in a subprocess
whose working folder is a fresh empty temporary folder, so ``data/synthetic`` (1,000 synthetic users, generated and
preprocessed on first use) and ``runs/quickstart`` start absent, as in a fresh clone. Reported per run: wall seconds,
CPU seconds (user + sys of the child, what ``/usr/bin/time`` reports), the data phase (the log's ``generating`` line
to its ``test split`` line, 1 s resolution), the 40 rounds (the sum of ``metrics.csv``'s ``seconds``), the rest
(start-up and the final files) and the load average before the run; and the result (final test accuracy and the
three epsilons), which must be the same in every run.

``--baseline REV`` also measures the code at git revision ``REV`` (a temporary ``git worktree``, removed at the
end), interleaved with the current code and alternating which goes first, since a shared machine's load moves
whole runs.

    python benchmarks/quickstart_first_minute.py [--baseline HEAD~3] [--repeat 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from machine import machine_line  # noqa: E402

RESULT_KEYS = ("test_accuracy", "epsilon_rdp", "epsilon_prv", "epsilon_pld")


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """The repository at ``rev`` as a temporary detached worktree."""
    folder = Path(tempfile.mkdtemp(prefix="quickstart-baseline-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), rev], check=True,
                   capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(folder)], check=True,
                       capture_output=True)


def _clock(log: str, pattern: str) -> float | None:
    """Seconds since midnight of the first log line matching ``pattern`` (``HH:MM:SS LEVEL ...`` lines)."""
    match = re.search(r"^(\d\d):(\d\d):(\d\d) .*" + pattern, log, re.MULTILINE)
    return None if match is None else 3600 * int(match[1]) + 60 * int(match[2]) + int(match[3])


def measure(code: Path) -> dict:
    """One clean-start ``fedprivacy run`` of the code in ``code``, in a fresh empty working folder."""
    with tempfile.TemporaryDirectory(prefix="quickstart-run-") as work:
        load = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "fedprivacy", "run"], cwd=work, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(code)})
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"fedprivacy run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        run_dir = Path(work) / "runs" / "quickstart"
        summary = json.loads((run_dir / "summary.json").read_text())
        with open(run_dir / "metrics.csv") as f:
            rounds = sum(float(row["seconds"]) for row in csv.DictReader(f))
        generating, prepared = _clock(proc.stderr, "generating synthetic"), _clock(proc.stderr, "test split:")
        data = None if generating is None or prepared is None else prepared - generating
        return {"wall_s": round(wall, 2),
                "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2),
                "data_s": data, "rounds_s": round(rounds, 2),
                "rest_s": None if data is None else round(wall - data - rounds, 2), "load_before": load,
                "result": {k: summary[k] for k in RESULT_KEYS}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="git revision to compare with (a temporary worktree)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the report here (JSON)")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    with contextlib.ExitStack() as stack:
        codes = {"current": REPO}
        if args.baseline:
            codes = {f"baseline {args.baseline}": stack.enter_context(checkout(args.baseline)), **codes}
        runs: dict[str, list[dict]] = {name: [] for name in codes}
        for repeat in range(args.repeat):
            order = list(codes) if repeat % 2 == 0 else list(reversed(codes))
            for name in order:
                runs[name].append(measure(codes[name]))
                print(json.dumps({"kind": name, "repeat": repeat, **runs[name][-1]}), flush=True)
    report = {"machine": machine_line(), "runs": runs,
              "median_wall_s": {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()},
              "median_cpu_s": {name: statistics.median(r["cpu_s"] for r in rs) for name, rs in runs.items()},
              "same_result": len({json.dumps(r["result"], sort_keys=True) for rs in runs.values() for r in rs}) == 1}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if report["same_result"] else 1


if __name__ == "__main__":
    sys.exit(main())
