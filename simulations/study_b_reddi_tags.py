"""Study (b): Reddi et al.'s tag prediction at epsilon 1, 3 and 8 on a larger synthetic population.

Multi-label tags (recall@5) on 5,000 synthetic users, adaptive server optimizers (FedAdagrad, FedAdam)
against DP-FedAvg(M), noise calibrated per budget; reduced number of rounds (docs/STUDIES.md).

Runs ``fedprivacy compare configs/study_b_reddi_tags.yaml`` end to end (data, runs, tables, figures and
report.md under the study's output_dir); arguments are passed on (``--jobs``, ``--set``).
Expected and measured results: docs/STUDIES.md.

    python simulations/study_b_reddi_tags.py [--jobs 2]
"""

import sys
from pathlib import Path

from fedprivacy.cli import main

if __name__ == "__main__":
    study = Path(__file__).resolve().parents[1] / "configs" / "study_b_reddi_tags.yaml"
    sys.exit(main(["compare", str(study), *sys.argv[1:]]))
