"""Correlated noise (BLT) with fedprivacy's DPFedAvg in a Flower ServerApp: the stock client of dp_strategy.py,
min-separated participation over 5 groups (each user at most every 5 rounds), one Gaussian for the whole run.

Run: python examples/correlated_noise.py   (fedprivacy's in-process engine; no Ray, no SuperLink)
"""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from torch import nn

from dp_strategy import USERS, accuracy, client_app  # this folder's stock ClientApp (the script's folder is on sys.path)
from fedprivacy import CorrelatedMechanism, DPFedAvg
from fedprivacy.engines.inprocess import run_inprocess

ROUNDS, GROUPS = 20, 5
server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    blt = CorrelatedMechanism(kind="blt", horizon=ROUNDS, groups=GROUPS, buffers=3)
    strategy = DPFedAvg(noise_multiplier=2.0, clip_norm=1.0, expected_cohort=10, population=USERS, delta=1e-3,
                        sampling="min_separated", groups=GROUPS, noise_stream=blt,
                        optimizer="sgd", lr=0.5, optimizer_settings={"momentum": 0.9})
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(nn.Linear(20, 2).state_dict()),
                            num_rounds=ROUNDS, train_config=ConfigRecord())
    print(f"accuracy {accuracy(result.arrays):.3f} (majority ~0.5), epsilon {strategy.epsilons()['rdp']:.2f} at delta 1e-3 "
          f"({blt.describe()}: one Gaussian of z = 2 for the {ROUNDS} rounds)")


if __name__ == "__main__":
    run_inprocess(server_app, client_app, USERS)
