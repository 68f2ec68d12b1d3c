"""Study (a): AdaDPS's federated StackOverflow setup on the synthetic data.

400 users, 20 per round, sigma 0.3, 40 rounds, delta 1/400 (local training 5 epochs of batch 10, see
docs/STUDIES.md), comparing DP-FedAvg(M), DP-FedAdam, DP-FedAdamBC, AdaDPS, server DiSK and server
DP-MicroAdam at one budget, 3 seeds.

Runs ``fedprivacy compare configs/study_a_adadps_federated.yaml`` end to end (data, runs, tables, figures and
report.md under the study's output_dir); arguments are passed on (``--jobs``, ``--set``).
Expected and measured results: docs/STUDIES.md.

    python simulations/study_a_adadps_federated.py [--jobs 2] [--set seeds=[0]]
"""

import sys
from pathlib import Path

from fedprivacy.cli import main

if __name__ == "__main__":
    study = Path(__file__).resolve().parents[1] / "configs" / "study_a_adadps_federated.yaml"
    sys.exit(main(["compare", str(study), *sys.argv[1:]]))
