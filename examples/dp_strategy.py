"""fedprivacy's DPFedAvg strategy in a Flower ServerApp, with a plain PyTorch ClientApp.

Run: python examples/dp_strategy.py   (fedprivacy's in-process engine; no Ray, no SuperLink)
"""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import nn

from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy import Accounting, Bounding, DPFedAvg, Noise, Participation, ServerStepPart

USERS = 50
client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:  # a stock Flower client: local SGD, full weights back
    model = nn.Linear(20, 2)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    gen = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
    x = torch.randn(64, 20, generator=gen)
    y = (x[:, 0] > 0).long()  # every user's data follows the same rule
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": 64})}), reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = DPFedAvg(participation=Participation(expected_cohort=10, population=USERS),
                        bounding=Bounding(clip_norm=1.0), noise=Noise(noise_multiplier=1.0),
                        server_step=ServerStepPart("adam", lr=0.05, optimizer_settings={"tau": 1e-3}),
                        accounting=Accounting(delta=1e-3))
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(nn.Linear(20, 2).state_dict()), num_rounds=20,
                            train_config=ConfigRecord())
    print(f"accuracy {accuracy(result.arrays):.3f} (majority ~0.5), epsilon {strategy.epsilons()['rdp']:.2f} at "
          "delta 1e-3")


def accuracy(arrays: ArrayRecord) -> float:
    """The model's accuracy on 2,000 fresh points of the users' common rule."""
    model = nn.Linear(20, 2)
    model.load_state_dict(arrays.to_torch_state_dict())
    x = torch.randn(2000, 20, generator=torch.Generator().manual_seed(10**6))
    return float((model(x).argmax(1) == (x[:, 0] > 0).long()).float().mean())


if __name__ == "__main__":
    run_inprocess(server_app, client_app, USERS)
