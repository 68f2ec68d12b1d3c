"""Every server variant through the same DP-FedAvg pipeline at one fixed privacy budget.

The study is configs/compare_server_optimizers.yaml (the quickstart's setting, every server optimizer
on a small server-lr grid); results and reading in docs/COMPARISON.md.

    python simulations/compare_server_optimizers.py [--jobs 2] [--set output_dir=runs/compare]
"""

from fedprivacy.cli import run_study_script

if __name__ == "__main__":
    run_study_script(__file__, "compare_server_optimizers.yaml")
