"""Flower ClientApp: local SGD on one StackOverflow user's posts, reply with the model delta.

Message contract (``message_type``):

- ``query.identity``: reply ``{"node": ConfigRecord({"partition-id": i})}`` so the server can map its
  population onto node ids before round 1 (:func:`~fedprivacy.fl.mods.answer_identity_query`).
- ``train``: content ``{"arrays": x_t, "config": {"server-round": t}}`` (server DiSK adds
  ``"lookahead": x_t + gamma d`` and ``config["disk-c"]``: the client then trains from both points
  with the same data order and sends ``c Delta(lookahead) + (1 - c) Delta(x_t)``); reply
  ``{"arrays": Delta_i = x_local - x_t (flat COO: indices, values), "metrics": {"train_loss",
  "num-examples"}}``.
  With ``client.sample_dp`` the client trains with record-level DP
  (:func:`~fedprivacy.client.sample_dp.train_sample_dp_softmax`, a dense delta) and adds its
  round's releases to the metrics (:func:`~fedprivacy.privacy.client_ledgers.event_metrics`: noise
  multiplier, q_i, steps, n_i in units, its delta) for the server's per-client ledger.
  With ``client.adadps`` the config names ``"adadps-version"`` and, the first time, the content
  carries ``"adadps"``: the public ``A`` the node keeps in its ``Context.state`` and divides every
  local gradient by (:mod:`fedprivacy.fl.side_information`).
  Central placement (default): the client does not clip; the server clips what it receives
  (invariant 1 holds because the reply IS the transmitted vector). Distributed and local
  placements: the client clips and adds its noise itself and sends the DENSE noised vector
  (:mod:`fedprivacy.privacy.placement`). With ``client.compression`` it sends the clipped top-k of
  its delta plus the residual it keeps in ``Context.state``.
  A canary's node (the content carries :data:`~fedprivacy.fl.canary_client.CANARY_RECORD`) trains nothing: it sends
  the canary's update (:func:`~fedprivacy.fl.canary_client.canary_result`) through the same upload, without
  ``train_loss``.

One reply path: whatever trained, :func:`client_reply` turns the client's local training into its
reply with the steps of :mod:`fedprivacy.fl.mods` (:func:`~fedprivacy.fl.mods.compressed_upload`,
:func:`~fedprivacy.fl.mods.noised_upload`, the residual under :data:`~fedprivacy.fl.mods.RESIDUAL_KEY`),
and the cohort engine (:mod:`fedprivacy.engines.cohorts`) builds each reply with it too.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from fedprivacy.client.trainer import LocalResult, client_generator, local_sgd
from fedprivacy.config import DataConfig, RunConfig, SampleDPClientConfig
from fedprivacy.models.logit_losses import closed_form_loss
from fedprivacy.optim.disk import disk_combination
from fedprivacy.updates import SparseUpdate
from fedprivacy.privacy.noise import GaussianNoise, torch_seed
from fedprivacy.privacy.placement import client_noise_std
from fedprivacy.fl.canary_client import CANARY_RECORD, canary_result
from fedprivacy.fl.mods import RESIDUAL_KEY, answer_identity_query, compressed_upload, noised_upload
from fedprivacy.fl.noise_floor import NoiseFloor, SecAggNode, enforce
from fedprivacy.fl.secure_aggregation import ClientSettings, handle, is_secagg
from fedprivacy.fl.records import load_record_, record_to_vector, update_to_record
from fedprivacy.fl.run_config import config_from_context
from fedprivacy.fl.side_information import node_side_information
from fedprivacy.stackoverflow_tasks import load_task

if TYPE_CHECKING:
    from fedprivacy.optim.sample_dp import SampleDPConfig

SAMPLE_DP_STREAM = 0x73616D706C65  # "sample": a client's sample-level DP streams, per (run seed, round, client)
COMPRESSION_STREAM = 0x636F6D70  # "comp": a client's stochastic rounding of its residual, per (run seed, round, client)
RESIDUAL = RESIDUAL_KEY
"""``Context.state`` key of the error-feedback residual: the mods' one (:func:`~fedprivacy.fl.mods.compressed_upload`)."""
LEGACY_RESIDUAL = "uplink-residual"
"""Where this ClientApp kept the residual before it shared the mods' key (node states in checkpoints of
fedprivacy up to commit de2febe); :func:`adopt_legacy_residual` moves it."""


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
    if not load_record_(model, record):
        raise ValueError("broadcast arrays do not match the model's parameters")
    _loaded[model] = record


class LastDecoded:
    """Single-entry cache: decode a record shared by all messages of a round once per process."""

    def __init__(self) -> None:
        self._record: ArrayRecord | None = None
        self._vector: torch.Tensor | None = None

    def vector(self, record: ArrayRecord, model: torch.nn.Module, device: str) -> torch.Tensor:
        if record is not self._record:
            vector = record_to_vector(record, model, device)
            if vector is None:
                raise ValueError("lookahead arrays do not match the model's parameters")
            self._record, self._vector = record, vector
        return self._vector


def sample_dp_config(s: SampleDPClientConfig) -> SampleDPConfig:
    """The optimizer hyperparameters of ``client.sample_dp`` (other settings: SampleDPConfig's defaults)."""
    from fedprivacy.optim.sample_dp import SampleDPConfig  # Opacus: imported only by clients that use it

    return SampleDPConfig(base=s.optimizer, lr=s.lr, noise_multiplier=s.noise_multiplier, clip_norm=s.clip_norm,
                          batch_size=s.batch_size, micro_batch_size=s.micro_batch_size or 1,
                          disk_kappa=s.disk_kappa, disk_gamma=s.disk_gamma)


def build_client_app(cfg: RunConfig | None = None, mods: list[Mod] | None = None) -> ClientApp:
    """A ClientApp bound to ``cfg`` (or reading it from Flower's run config when ``cfg`` is None),
    with optional Flower mods (client-side middleware) wrapped around it.

    Client-side noise (distributed shares, local noise, record-level DP) is seeded from the run seed
    only in a SIMULATION, i.e. an app bound to ``cfg`` by fedprivacy's own engines (in-process, Ray).
    The app that Flower loads on a real SuperNode (``cfg`` None, the config comes from the server)
    always draws it from the OS's cryptographic source: a seed the server knows, or could set,
    would let the server subtract the noise that is meant to protect the client from it. For the
    same reason that app refuses to train under a client-side placement unless the server's noise
    settings are at least the floor of its own node config (:mod:`fedprivacy.fl.noise_floor`): an
    error reply, which the server counts as a dropout.
    """
    app = ClientApp(mods=mods)
    lookaheads = LastDecoded()

    answer_identity_query(app)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        c = cfg if cfg is not None else config_from_context(context)[0]
        if cfg is None:  # a deployed client: the server's noise settings, held against its own node config's floor
            enforce(NoiseFloor.from_node_config(context.node_config), c.privacy)
        if c.privacy.secure_aggregation is not None and is_secagg(msg):  # SecAgg+: training in its collect stage
            return handle(msg, context, _secagg_settings(c, context, deployed=cfg is None), train_plain)
        return train_plain(msg, context)

    def train_plain(msg: Message, context: Context) -> Message:
        c = cfg if cfg is not None else config_from_context(context)[0]
        job = ClientJob.of(msg, int(context.node_config["partition-id"]), c, simulated=cfg is not None)
        model = _working_model(c.data, c.device)
        _load_broadcast(model, msg.content["arrays"], c.device)
        canary = msg.content.config_records.get(CANARY_RECORD)
        if canary is None:
            trained, extra_metrics = _train(msg, context, c, job, model, lookaheads)
            return client_reply(msg, context.state, c, job, model, trained, extra_metrics)
        dim = sum(p.numel() for p in model.parameters())  # a canary's node: its update instead of training
        reply = client_reply(msg, context.state, c, job, model,
                             canary_result(canary, dim, float(msg.content["config"]["clip-norm"])))
        reply.content.metric_records["metrics"].pop("train_loss", None)  # it trained nothing
        return reply

    return app


def _secagg_settings(c: RunConfig, context: Context, deployed: bool) -> ClientSettings:
    """A client's SecAgg+ settings: the server's noise settings with, on a deployed client (``deployed``), the
    threshold, neighbourhood, identity key and roster of its own node config and noise from the OS; in a
    simulation the run's, seeded from the run seed unless ``secure_noise``."""
    p, secagg = c.privacy, c.privacy.secure_aggregation
    assert p.noise_multiplier != "auto", "the server sends the calibrated config"
    assert secagg is not None
    if deployed:
        node = SecAggNode.from_node_config(context.node_config)
        return ClientSettings(p.noise_multiplier, p.clip_norm, p.expected_cohort, secagg.bits, node.threshold,
                              node.neighbours, roster=node.roster, identity_key=node.identity_key)
    return ClientSettings(p.noise_multiplier, p.clip_norm, p.expected_cohort, secagg.bits, secagg.threshold,
                          secagg.neighbours, seed=None if p.secure_noise else c.seed)


@dataclass(frozen=True)
class ClientJob:
    """Who trains which round: the node's partition, the round, the server's noise epoch (a re-run of
    released rounds after a resume draws fresh streams) and whether client noise must be secret."""

    partition: int
    round: int
    epoch: tuple[int, ...]
    secret: bool

    @classmethod
    def of(cls, msg: Message, partition: int, c: RunConfig, simulated: bool) -> ClientJob:
        """The job of ``msg`` on the node of ``partition``; ``simulated``: ``c`` came from fedprivacy's own
        engine (its seeded streams), not from the server (the OS's)."""
        config = msg.content["config"]
        return cls(partition=partition, round=int(config["server-round"]),
                   epoch=(int(config["noise-epoch"]),) if "noise-epoch" in config else (),
                   secret=c.privacy.secure_noise or not simulated)


def client_reply(msg: Message, state: RecordDict, c: RunConfig, job: ClientJob, model: torch.nn.Module,
                 trained: LocalResult, extra_metrics: Mapping[str, float] = MappingProxyType({})) -> Message:
    r"""The reply to ``msg`` from the client's local training ``trained`` (:math:`\Delta_i`, its loss and
    example count) and ``extra_metrics`` (the record-level events): the one reply path of the ClientApp
    and of the cohort engine. The upload, in order:

    .. math:: u_i = \Delta_i \ (\text{central}); \quad
              u_i \leftarrow \operatorname{clip}(T_k(u_i + e_i), C_t) \ (\texttt{client.compression}); \quad
              u_i \leftarrow \operatorname{clip}(u_i, C) + \mathcal N(0, s^2 I_d) \ (\text{distributed, local})

    with :math:`e_i` the residual in the node's ``state`` (:func:`~fedprivacy.fl.mods.compressed_upload`; its
    stochastic rounding seeded per (run seed, round, partition); metric ``residual-bytes``), :math:`C_t` the
    round's ``clip-norm``, :math:`s = zC/\sqrt m` or :math:`zC` (:func:`~fedprivacy.fl.mods.noised_upload`)
    drawn from the stream ``(round, partition, *epoch)`` of the run seed, or from the OS when ``job.secret``.
    ``model`` gives the parameter sizes of per-tensor top-k. Under distributed and local placement the server
    is not trusted: the reply carries only the noisy upload and ``extra_metrics`` (the record-level events it
    must account), not the loss, the example count or the residual's size, which are not privatized.
    """
    update = trained.update
    metrics = {"train_loss": trained.train_loss, "num-examples": trained.num_examples}
    comp = c.client.compression
    if comp is not None:
        rounding = None
        if comp.quantization == "4bit_stochastic":
            seq = np.random.SeedSequence([c.seed, COMPRESSION_STREAM, job.round, job.partition])
            rounding = torch.Generator().manual_seed(torch_seed(seq))
        update, residual_bytes = compressed_upload(
            update, state, density=comp.density, clip_norm=float(msg.content["config"]["clip-norm"]),
            quantization=comp.quantization, bucket_size=comp.bucket_size, generator=rounding,
            tensor_sizes=[p.numel() for p in model.parameters()] if comp.per_tensor else None)
        metrics["residual-bytes"] = float(residual_bytes)
    p = c.privacy
    if p.secure_aggregation is not None:  # the SecAgg+ handler clips, adds the Skellam share and masks
        metrics = {}
    elif p.placement != "central":  # the client clips and adds its noise (its own generator per round)
        update = noised_upload(update, p.clip_norm, client_noise_std(p.placement, p.noise_multiplier, p.clip_norm,
                                                                     p.expected_cohort),
                               GaussianNoise(c.seed, device=c.device, secure=job.secret,
                                             stream=(job.round, job.partition, *job.epoch)))
        metrics = {}  # nothing but the noisy upload and the events leaves the client
    return Message(RecordDict({"arrays": update_to_record(update), "metrics": MetricRecord({**metrics, **extra_metrics})}),
                   reply_to=msg)


def adopt_legacy_residual(state: RecordDict) -> bool:
    """Move a residual that ``state`` (a node's ``Context.state`` from an older checkpoint) holds under
    :data:`LEGACY_RESIDUAL` to :data:`RESIDUAL`, in place; whether there was one."""
    held = state.array_records.get(LEGACY_RESIDUAL)
    if held is None:
        return False
    if RESIDUAL in state:
        raise ValueError(f"a node state holds an uplink residual under both {LEGACY_RESIDUAL!r} and {RESIDUAL!r}")
    state[RESIDUAL] = held
    del state[LEGACY_RESIDUAL]
    return True


def _train(msg: Message, context: Context, c: RunConfig, job: ClientJob, model: torch.nn.Module,
           lookaheads: LastDecoded) -> tuple[LocalResult, dict[str, float]]:
    """The client's local training: record-level DP, plain local SGD, or DiSK's two passes from
    ``x_t`` and the lookahead with one data order. Returns the update it sends (DiSK's combination),
    with the loss and example count of its last pass, and extra metrics (the record-level privacy
    events)."""
    task = load_task(c.data)
    features, labels = task.client_data(job.partition)
    side = node_side_information(msg, context, c.device)  # AdaDPS's public A, or None
    s = c.client.sample_dp
    if s is not None:  # record-level DP; the config excludes DiSK's lookahead
        from fedprivacy.client.sample_dp import train_sample_dp_softmax  # Opacus, on demand
        from fedprivacy.privacy.client_ledgers import event_metrics

        seed = np.random.SeedSequence([c.seed, SAMPLE_DP_STREAM, job.round, job.partition, *job.epoch])
        result = train_sample_dp_softmax(model, features, labels, sample_dp_config(s), seed, epochs=s.epochs,
                                         target_delta=s.target_delta, delta_factor=s.delta_factor,
                                         accountant=s.accountant, secure_noise=job.secret,
                                         preconditioner=None if side is None else
                                         (side["embedding.weight"], side.get("bias")))
        trained = LocalResult(SparseUpdate.dense(result.delta), result.train_loss, result.num_examples)
        return trained, event_metrics(result)
    closed_form = closed_form_loss(task)  # the tag models' fast path (softmax or multi-label BCE)

    def train_from(start: torch.Tensor | None):  # the same data order for every pass (common randomness)
        return local_sgd(model, features, labels, epochs=c.client.epochs, batch_size=c.client.batch_size,
                         lr=c.client.lr, rng=client_generator(c.seed, job.round, job.partition), start_from=start,
                         loss_fn=task.loss, closed_form=closed_form, preconditioner=side)

    lookahead = msg.content.array_records.get("lookahead")
    if lookahead is None:
        return train_from(None), {}
    coefficient = float(msg.content["config"]["disk-c"])
    ahead = train_from(lookaheads.vector(lookahead, model, c.device))
    return combine_disk_passes(ahead, None if coefficient == 1.0 else train_from(None), coefficient), {}


def combine_disk_passes(ahead: LocalResult, current: LocalResult | None, coefficient: float) -> LocalResult:
    """DiSK's upload from the pass from the lookahead and the pass from ``x_t`` (None: ``c = 1``, one pass):
    ``c Delta(lookahead) + (1 - c) Delta(x_t)`` (:func:`~fedprivacy.optim.disk.disk_combination`), with the
    loss and example count of the last pass."""
    last = ahead if current is None else current
    return LocalResult(disk_combination(ahead.update, None if current is None else current.update, coefficient),
                       last.train_loss, last.num_examples)


app = build_client_app()
