"""Flower ClientApp: local SGD on one StackOverflow user's posts, reply with the model delta.

Message contract (``message_type``):

- ``query``: reply ``{"node": ConfigRecord({"partition-id": i})}`` so the server can map its
  population onto node ids before round 1.
- ``train``: content ``{"arrays": x_t, "config": {"server-round": t}}``; reply
  ``{"arrays": Delta_i = x_local - x_t (flat COO: indices, values), "metrics": {"train_loss",
  "num-examples"}}``.
  The client does not clip: the server clips what it receives (central DP; invariant 1 holds
  because the reply IS the transmitted vector).
"""

from __future__ import annotations

import functools
import weakref

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod
from torch.nn.utils import vector_to_parameters

from fedprivacy.client.trainer import client_generator, local_sgd
from fedprivacy.config import DataConfig, RunConfig
from fedprivacy.fl.records import record_to_vector, update_to_record
from fedprivacy.fl.server_app import config_from_context
from fedprivacy.task import load_task


@functools.lru_cache(maxsize=2)
def _working_model(data: DataConfig, device: str) -> torch.nn.Module:
    """One reusable model per process; it always holds the last broadcast it was given."""
    return load_task(data).new_model(device)


_loaded: weakref.WeakKeyDictionary[torch.nn.Module, ArrayRecord] = weakref.WeakKeyDictionary()


def _load_broadcast(model: torch.nn.Module, record: ArrayRecord, device: str) -> None:
    """Copy ``x_t`` into ``model`` unless it already holds this very record.

    In-process, every message of a round carries the SAME ``ArrayRecord`` object and
    ``local_sgd`` restores ``x_t`` after each client, so the 5M-parameter copy happens once per
    round rather than once per client. (Over Ray each message is a fresh object: copied each time.)
    """
    if _loaded.get(model) is record:
        return
    vector = record_to_vector(record, model, device)
    if vector is None:
        raise ValueError("broadcast arrays do not match the model's parameters")
    vector_to_parameters(vector, model.parameters())
    _loaded[model] = record


def build_client_app(cfg: RunConfig | None = None, mods: list[Mod] | None = None) -> ClientApp:
    """A ClientApp bound to ``cfg`` (or reading it from Flower's run config when ``cfg`` is None),
    with optional Flower mods (client-side middleware) wrapped around it."""
    app = ClientApp(mods=mods)
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
        _load_broadcast(model, msg.content["arrays"], c.device)
        features, labels = load_task(c.data).client_data(partition)
        result = local_sgd(model, features, labels, epochs=c.client.epochs, batch_size=c.client.batch_size,
                           lr=c.client.lr, rng=client_generator(c.seed, server_round, partition))
        content = RecordDict({
            "arrays": update_to_record(result.update),
            "metrics": MetricRecord({"train_loss": result.train_loss, "num-examples": result.num_examples}),
        })
        return Message(content, reply_to=msg)

    return app


app = build_client_app()
