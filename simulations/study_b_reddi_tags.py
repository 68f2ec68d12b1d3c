"""Study (b), Reddi-style tag prediction (recall@5) at epsilon 1, 3 and 8, reduced scale.

DP-FedAvgM against DP-FedAdagrad and DP-FedAdam on 5,000 synthetic users, noise calibrated per budget;
what the papers report and what this shows: docs/STUDIES.md. Arguments go to ``fedprivacy compare``.

    python simulations/study_b_reddi_tags.py --jobs 2
"""

from fedprivacy.cli import run_study_script

if __name__ == "__main__":
    run_study_script(__file__, "study_b_reddi_tags.yaml")
