"""DP-FedAdam vs DP-FedAdamBC at z = 0.3 and without noise, DP-FedAvgM as a reference (docs/COMPARISON.md).

The study is configs/compare_adambc_low_noise.yaml (configs/compare_adambc_regime.yaml at less noise).

    python simulations/compare_adambc_low_noise.py [--jobs 2] [--set seeds=[0]]
"""

from fedprivacy.cli import run_study_script

if __name__ == "__main__":
    run_study_script(__file__, "compare_adambc_low_noise.yaml")
