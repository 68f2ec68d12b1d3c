"""SecAgg+ with distributed Skellam noise: fedprivacy's DPFedAvg in a Flower ServerApp and the stock client of
dp_strategy.py with fedprivacy's SecAgg+ mod. Each client clips its update, adds its integer Skellam share and
uploads it masked; the server learns only the sum of the survivors' shares, and accounts each round with the noise
they actually added (RDP).

Run: python examples/secure_aggregation.py   (fedprivacy's in-process engine; no Ray, no SuperLink)
"""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import nn

from dp_strategy import USERS, accuracy, train  # this folder's stock client (the script's folder is on sys.path)
from fedprivacy import DPFedAvg, SecureAggregation, secure_aggregation_mod

ROUNDS, COHORT, Z, C, BITS = 10, 10, 1.0, 1.0, 20
THRESHOLD, NEIGHBOURS = 4, 5  # each client refuses any other threshold or a larger neighbourhood
client_app = ClientApp(mods=[secure_aggregation_mod(noise_multiplier=Z, clip_norm=C, expected_cohort=COHORT, bits=BITS,
                                                    threshold=THRESHOLD, neighbours=NEIGHBOURS)])
client_app.train()(train)
server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = DPFedAvg(noise_multiplier=Z, clip_norm=C, expected_cohort=COHORT, population=USERS, delta=1e-3,
                        placement="distributed", accountants=("rdp",),
                        secure_aggregation=SecureAggregation(threshold=THRESHOLD, neighbours=NEIGHBOURS, bits=BITS),
                        optimizer="sgd", lr=0.5, optimizer_settings={"momentum": 0.9})
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(nn.Linear(20, 2).state_dict()),
                            num_rounds=ROUNDS, train_config=ConfigRecord())
    # A round whose Poisson cohort or survivors fall below the threshold aborts: nothing released, nothing accounted.
    aborted = sum(int(m.get("secagg_aborted", 0)) for m in result.train_metrics_clientapp.values())
    print(f"accuracy {accuracy(result.arrays):.3f} (majority ~0.5), epsilon {strategy.epsilons()['rdp']:.2f} at delta 1e-3 "
          f"after {strategy.mechanism.ledger.rounds} Skellam rounds, {aborted} aborted below the threshold "
          "(the server saw only masked uploads)")


if __name__ == "__main__":
    from fedprivacy.engines.inprocess import run_inprocess

    run_inprocess(server_app, client_app, USERS)
