"""Study (a): AdaDPS's federated StackOverflow protocol on the TFF-shaped synthetic data, end to end.

400 users, 20 per round, sigma 0.3, 40 rounds, delta 1/400, 1 local epoch of batch 100, server lr 1;
DP-FedAvg, DP-FedAdam and AdaDPS with the clip C tuned per method on held-out users, 5 seeds: data,
90 runs, tables, figures and report.md in runs/study_a_adadps_federated (docs/STUDIES.md).

    python simulations/study_a_adadps_federated.py [--jobs 2] [--set seeds=[0]]
"""

from fedprivacy.cli import run_study_script

if __name__ == "__main__":
    run_study_script(__file__, "study_a_adadps_federated.yaml")
