"""Every server variant through the same DP-FedAvg pipeline at one fixed privacy budget.

The study is ``configs/compare_server_optimizers.yaml`` (the quickstart's setting, every server
optimizer on a small server-lr grid); this entry point is ``fedprivacy compare`` on it. It writes
the study folder (``runs/compare``: per-run folders, ``results/``, ``figures/``, ``report.md``);
the measured table and what it shows are in docs/COMPARISON.md.

    python simulations/compare_server_optimizers.py [--jobs 2] [--set output_dir=runs/compare] [--set base.rounds=40]
"""

import sys
from pathlib import Path

from fedprivacy.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", str(Path(__file__).resolve().parents[1] / "configs" / "compare_server_optimizers.yaml"),
                   *sys.argv[1:]]))
