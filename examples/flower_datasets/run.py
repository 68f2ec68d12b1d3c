"""Run the digit-writers Flower App on fedprivacy's in-process engine (no Ray, no SuperLink): a few seconds.

    python examples/flower_datasets/run.py                                  # the pyproject.toml defaults
    python examples/flower_datasets/run.py -c "noise-placement='distributed' num-server-rounds=20"

``-c``/``--run-config`` takes the same ``key=value`` overrides as ``flwr run -c``; one SuperNode per writer.
"""

import argparse
import logging

from flwr.common.config import parse_config_args

from digit_writers import task
from digit_writers.client_app import app as client_app
from digit_writers.server_app import app as server_app
from fedprivacy.engines.inprocess import run_inprocess

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--run-config", action="append", default=[],
                        help='overrides of [tool.flwr.app.config], e.g. "num-server-rounds=20 noise-multiplier=1.5"')
    parser.add_argument("-q", "--quiet", action="store_true", help="only the final line, not Flower's round log")
    args = parser.parse_args()
    if args.quiet:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    task.DEFAULTS.update(parse_config_args(args.run_config))
    writers = task.load_task(task.DEFAULTS["data-dir"], task.DEFAULTS["seed"]).population
    run_inprocess(server_app, client_app, num_nodes=writers)
