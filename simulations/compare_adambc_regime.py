"""DP-FedAdam vs DP-FedAdamBC at beta2 0.9, 0.99, 0.999 over 200 rounds, one budget (docs/COMPARISON.md).

The study is configs/compare_adambc_regime.yaml; the table reports accuracy beside the share of
coordinates DP-FedAdamBC floors at gamma' (metrics.csv ``adambc_floored_fraction``).

    python simulations/compare_adambc_regime.py [--jobs 2] [--set seeds=[0]]
"""

from fedprivacy.cli import run_study_script

if __name__ == "__main__":
    run_study_script(__file__, "compare_adambc_regime.yaml")
