"""Run the digits Flower App on fedprivacy's in-process engine (no Ray, no SuperLink): a few seconds.

    python examples/digits/run.py                                   # the pyproject.toml defaults
    python examples/digits/run.py -c "noise-multiplier=1.5 num-server-rounds=20"

``-c``/``--run-config`` takes the same ``key=value`` overrides as ``flwr run -c``.
"""

import argparse
import logging

from flwr.common.config import parse_config_args

from digits import task
from digits.client_app import app as client_app
from digits.server_app import app as server_app
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
    run_inprocess(server_app, client_app, num_nodes=task.DEFAULTS["num-users"])
