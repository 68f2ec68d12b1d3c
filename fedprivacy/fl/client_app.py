"""Flower ClientApp: local SGD on one StackOverflow user's posts, reply with the model delta.

Message contract (``message_type``):

- ``query``: reply ``{"node": ConfigRecord({"partition-id": i})}`` so the server can map its
  population onto node ids before round 1.
- ``train``: content ``{"arrays": x_t, "config": {"server-round": t}}``; reply
  ``{"arrays": Delta_i = x_local - x_t, "metrics": {"train_loss", "num-examples"}}``.
  The client does not clip: the server clips what it receives (central DP; invariant 1 holds
  because the reply IS the transmitted vector).
"""

from __future__ import annotations

import functools

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.nn.utils import vector_to_parameters

from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.config import DataConfig, RunConfig
from fedprivacy.fl.records import record_to_vector, vector_to_record
from fedprivacy.fl.server_app import config_from_context
from fedprivacy.task import load_task


@functools.lru_cache(maxsize=2)
def _working_model(data: DataConfig, device: str) -> torch.nn.Module:
    """One reusable model per process: its weights are overwritten by every broadcast."""
    return load_task(data).new_model(device)


class _BroadcastCache:
    """Decode a round's broadcast once per process, not once per client.

    In-process, every message of a round carries the SAME ``ArrayRecord`` object; holding a
    reference to it keeps the identity check sound.
    """

    def __init__(self) -> None:
        self._record: ArrayRecord | None = None
        self._vector: torch.Tensor | None = None

    def vector(self, record: ArrayRecord, model: torch.nn.Module, device: str) -> torch.Tensor:
        if record is not self._record:
            vector = record_to_vector(record, model, device)
            if vector is None:
                raise ValueError("broadcast arrays do not match the model's parameters")
            self._record, self._vector = record, vector
        return self._vector


def build_client_app(cfg: RunConfig | None = None) -> ClientApp:
    """A ClientApp bound to ``cfg``, or reading it from Flower's run config when ``cfg`` is None."""
    app = ClientApp()
    cache = _BroadcastCache()

    def run_config(context: Context) -> RunConfig:
        return cfg if cfg is not None else config_from_context(context)[0]

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        return Message(RecordDict({"node": ConfigRecord({"partition-id": partition})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        c = run_config(context)
        partition = int(context.node_config["partition-id"])
        server_round = int(msg.content["config"]["server-round"])
        model = _working_model(c.data, c.device)
        vector_to_parameters(cache.vector(msg.content["arrays"], model, c.device), model.parameters())
        features, labels = load_task(c.data).client_data(partition)
        result = local_sgd(model, features, labels, epochs=c.client.epochs, batch_size=c.client.batch_size,
                           lr=c.client.lr, rng=client_generator(c.seed, server_round, partition))
        content = RecordDict({
            "arrays": vector_to_record(result.delta, model),
            "metrics": MetricRecord({"train_loss": result.train_loss, "num-examples": result.num_examples}),
        })
        return Message(content, reply_to=msg)

    return app


app = build_client_app()
