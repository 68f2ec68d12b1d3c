"""Study (c): next-word prediction (TFF's LSTM) at one budget.

Server optimizers compared at epsilon 8 on the synthetic users, at a reduced scale (docs/STUDIES.md).

Runs ``fedprivacy compare configs/study_c_next_word.yaml`` end to end (data, runs, tables, figures and
report.md under the study's output_dir); arguments are passed on (``--jobs``, ``--set``).
Expected and measured results: docs/STUDIES.md.

    python simulations/study_c_next_word.py [--jobs 2]
"""

import sys
from pathlib import Path

from fedprivacy.cli import main

if __name__ == "__main__":
    study = Path(__file__).resolve().parents[1] / "configs" / "study_c_next_word.yaml"
    sys.exit(main(["compare", str(study), *sys.argv[1:]]))
