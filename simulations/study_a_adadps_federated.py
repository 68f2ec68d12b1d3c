"""Study (a): AdaDPS's federated StackOverflow setup on the synthetic data, end to end.

400 users, 20 per round, sigma 0.3, 40 rounds, delta 1/400 (local training 5 epochs of batch 10, see
docs/STUDIES.md); DP-FedAvg(M), DP-FedAdam, DP-FedAdamBC, AdaDPS, server DiSK and server DP-MicroAdam
at one budget, 3 seeds: data, 33 runs, tables, figures and report.md in runs/study_a.

    python simulations/study_a_adadps_federated.py [--jobs 2] [--set seeds=[0]]
"""

from fedprivacy.cli import run_study_script

if __name__ == "__main__":
    run_study_script(__file__, "study_a_adadps_federated.yaml")
