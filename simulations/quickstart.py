"""DP-FedAvg on synthetic StackOverflow tag prediction: the embedded default, end to end.

    python simulations/quickstart.py [--set key=value ...]

Same as ``fedprivacy run configs/quickstart.yaml``; prints the run's summary.
"""

import sys
from pathlib import Path

from fedprivacy.cli import main

if __name__ == "__main__":
    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    sys.exit(main(["run", str(config), *sys.argv[1:]]))
