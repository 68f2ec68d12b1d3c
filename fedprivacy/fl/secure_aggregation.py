r"""SecAgg+ (Bell et al. 2020, arXiv:2009.06807) on Flower's Message API, carrying the distributed Skellam
mechanism (:mod:`fedprivacy.privacy.skellam`): the server learns the sum of the clients' noisy integer shares
modulo :math:`2^b` and nothing else about any one of them.

One round is four exchanges of ``train`` messages, each carrying a ``"secagg"`` ``ConfigRecord`` with its
``stage`` (the stages of Flower's ``SecAggPlusWorkflow``):

1. ``setup``: each sampled node draws two EC key pairs (``c``: masks, ``s``: encryption) and sends the public
   halves;
2. ``share-keys``: each node gets its neighbours' public keys (a ring of ``neighbours`` nodes around it in a
   random order, Bell et al.'s k-regular graph), draws a self-mask seed ``b``, Shamir-shares ``b`` and its mask
   key ``c_sk`` ``threshold``-of-``neighbours`` and sends each neighbour its two shares, encrypted under their
   ECDH key (the server only forwards ciphertexts);
3. ``collect``: the model and the forwarded shares; the node trains and uploads
   :math:`y_i = v_i + \mathrm{PRG}(b_i) + \sum_{j} \pm \mathrm{PRG}(c_{ij}) \bmod 2^b`, with :math:`v_i` its
   Skellam share (:meth:`~fedprivacy.privacy.skellam.SkellamParams.encode`) and the sign ``+`` if
   :math:`i > j`; each pairwise mask cancels in the sum of two survivors; the upload travels as ``b`` bits per
   coordinate (:mod:`~fedprivacy.fl.bit_packing`);
4. ``unmask``: each survivor sends, for every neighbour, the share of ``b`` (neighbour survived) or of
   ``c_sk`` (neighbour dropped after sharing keys), never both for one node; with ``threshold`` shares the
   server removes the survivors' self masks and the dropped nodes' pairwise masks.

Primitives are Flower's own (``flwr.common.secure_aggregation`` and ``flwr.supercore.primitives``): ECDH key
agreement with HKDF, Fernet authenticated encryption, Shamir sharing. The masks' PRG is AES-256 in counter mode
(``cryptography``) keyed with SHA-256 of the seed, not Flower's ``pseudo_rand_gen``, which folds its seed into
32 bits (a server could search all 2^32 masks).

Failure: below ``threshold`` survivors at any stage, or too few shares to unmask, the round raises
:class:`SecAggAborted`; the strategy logs one line and releases and accounts nothing, except when it fails
during ``unmask``, after the release was logged ahead: that release stays accounted (over-counting, never
under-counting). Against what: an honest-but-curious server and up to ``threshold - 1`` colluding clients
per neighbourhood (Bell et al., Thm. 2, semi-honest setting); a server that lies about who dropped out is
caught only by the clients' checks here (disjoint active and dropped lists, at least ``threshold`` actives,
only neighbours); the malicious-server variant's signatures and consistency round are not implemented.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_utils import (share_keys_plaintext_concat,
                                                             share_keys_plaintext_separate)
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import (bytes_to_private_key, bytes_to_public_key, generate_key_pairs,
                                                  private_key_to_bytes, public_key_to_bytes)

from fedprivacy.fl.bit_packing import pack_bits, packed_size, padding_is_zero, unpack_bits
from fedprivacy.fl.records import _contract_view, arrays_to_record, reply_to_update, record_to_layout
from fedprivacy.privacy.skellam import SkellamParams, client_rng
from fedprivacy.updates import RejectedUpdate


log = logging.getLogger(__name__)

SECAGG = "secagg"
"""The ``ConfigRecord`` of every SecAgg+ message (its ``stage``) and the masked upload's ``ArrayRecord`` key."""
STATE = "fedprivacy-secagg"
"""``Context.state`` key of a node's protocol state (deleted when its round ends)."""
STAGES = ("setup", "share-keys", "collect", "unmask")


class SecAggAborted(RuntimeError):
    """The round cannot complete (too few survivors or shares); nothing of it is released."""


@dataclass(frozen=True)
class SecureAggregation:
    """SecAgg+'s parameters.

    Attributes:
        threshold: t, the shares needed to rebuild a node's secrets (and the fewest survivors a round completes
            with); at most ``neighbours``.
        neighbours: k, the size of each node's neighbourhood, itself included (odd; the whole cohort if larger).
        bits: b, the modulus ``2^b`` of the masked shares (:class:`~fedprivacy.privacy.skellam.SkellamParams`).
        timeout: seconds each stage waits for replies (None: until every node answered or was reported gone).
    """

    threshold: int
    neighbours: int
    bits: int = 20
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, int) and isinstance(self.neighbours, int)
                and 2 <= self.threshold <= self.neighbours):
            raise ValueError(f"secure aggregation needs integers 2 <= threshold <= neighbours, got threshold="
                             f"{self.threshold!r}, neighbours={self.neighbours!r}")
        if self.neighbours % 2 == 0:
            raise ValueError(f"secure aggregation: neighbours must be odd (a node and k/2 on each side), got "
                             f"{self.neighbours}")


def _record(values: Mapping[str, Any]) -> ConfigRecord:
    """A ``ConfigRecord`` of ``values`` without their empty lists (readers take a missing key as empty; Flower's
    ``count_bytes`` fails on an empty list)."""
    return ConfigRecord({k: v for k, v in values.items() if not (isinstance(v, list) and not v)})


def prg_mask(seed: bytes, size: int, bits: int) -> np.ndarray:
    """``size`` values uniform in ``[0, 2^bits)`` (uint32) from AES-256-CTR keyed with SHA-256 of ``seed``."""
    key = hashlib.sha256(seed).digest()
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(4 * size))
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32) & np.uint32((1 << bits) - 1)


def _ring(nodes: list[int], k: int, rng: random.Random) -> dict[int, list[int]]:
    """Each node's neighbourhood (itself included): the ``k`` nodes around it on a ring in a random order."""
    order = list(nodes)
    rng.shuffle(order)
    n, half = len(order), k // 2
    if k >= n:
        return {node: sorted(order) for node in order}
    return {node: sorted({order[(i + j) % n] for j in range(-half, half + 1)}) for i, node in enumerate(order)}


# -- server ------------------------------------------------------------------------------------------------
@dataclass
class SecAggRound:
    """The server's side of one round (module docstring): run :meth:`prepare` (setup, share keys), send
    :meth:`collect_content` with the model, then :meth:`unmask` the survivors' sum."""

    grid: Grid
    settings: SecureAggregation
    round: int
    rotation_seed: int
    nodes: list[int]
    neighbours: dict[int, list[int]] = field(default_factory=dict)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    forwarded: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    shared: set[int] = field(default_factory=set)

    def _exchange(self, stage: str, content: Callable[[int], ConfigRecord], nodes: Iterable[int]) -> dict[int, ConfigRecord]:
        """Send ``stage`` to ``nodes``; the replies without an error, by node (anything else is a dropout)."""
        def message(node: int) -> Message:
            record = content(node)
            record["stage"], record["round"] = stage, self.round
            return Message(RecordDict({SECAGG: record}), dst_node_id=node, message_type="train",
                           group_id=f"{self.round}-{stage}")

        out: dict[int, ConfigRecord] = {}
        for reply in self.grid.send_and_receive([message(n) for n in nodes], timeout=self.settings.timeout):
            node = reply.metadata.src_node_id
            if reply.has_error() or node not in self.neighbours or SECAGG not in reply.content.config_records:
                continue
            out[node] = reply.content.config_records[SECAGG]
        return out

    def check(self, survivors: Iterable[int]) -> None:
        """SecAggAborted unless every survivor and every node that dropped after sharing its keys keeps at least
        ``threshold`` surviving neighbours (whose shares the unmasking needs)."""
        alive = set(survivors)
        self._check("collect", alive, self.shared)

    def _check(self, stage: str, alive: Iterable[int], nodes: Iterable[int] | None = None) -> list[int]:
        alive = sorted(set(alive))
        for node in alive if nodes is None else nodes:
            if len(set(self.neighbours[node]) & set(alive)) < self.settings.threshold:
                raise SecAggAborted(f"round {self.round}: secure aggregation aborted at {stage}: node {node} has fewer "
                                    f"than threshold={self.settings.threshold} live neighbours ({len(alive)} of "
                                    f"{len(self.nodes)} nodes left)")
        if len(alive) < self.settings.threshold:
            raise SecAggAborted(f"round {self.round}: secure aggregation aborted at {stage}: {len(alive)} of "
                                f"{len(self.nodes)} nodes left, threshold={self.settings.threshold}")
        return alive

    def prepare(self) -> list[int]:
        """Setup and share keys; returns the nodes that will get the model (SecAggAborted below threshold)."""
        self.neighbours = _ring(self.nodes, self.settings.neighbours, random.SystemRandom())
        setup = self._exchange("setup", lambda n: ConfigRecord({"threshold": self.settings.threshold,
                                                                "neighbours": len(self.neighbours[n])}), self.nodes)
        for node, reply in setup.items():
            keys = (reply.get("pk1"), reply.get("pk2"))
            try:
                if not all(isinstance(k, bytes) for k in keys):
                    raise ValueError("missing keys")
                for key in keys:
                    bytes_to_public_key(key)  # type: ignore[arg-type]
            except ValueError:
                continue
            self.public_keys[node] = keys  # type: ignore[assignment]
        alive = self._check("setup", self.public_keys)

        def keys_for(node: int) -> ConfigRecord:
            return ConfigRecord({str(j): list(self.public_keys[j]) for j in self.neighbours[node] if j in alive})

        shared = self._exchange("share-keys", keys_for, alive)
        self.forwarded = {n: [] for n in alive}
        for src, reply in shared.items():
            dsts, texts = reply.get("destinations"), reply.get("ciphertexts")
            if not (isinstance(dsts, list) and isinstance(texts, list) and len(dsts) == len(texts)):
                continue
            for dst, text in zip(dsts, texts):
                if dst in self.forwarded and dst in self.neighbours[src] and isinstance(text, bytes):
                    self.forwarded[dst].append((src, text))
        self.shared = set(self._check("share-keys", shared))
        return sorted(self.shared)

    def collect_content(self, node: int) -> ConfigRecord:
        """The ``secagg`` record of ``node``'s ``collect`` message: its neighbours' ciphertexts, the rotation seed."""
        pairs = [(src, text) for src, text in self.forwarded[node] if src in self.shared]
        return _record({"stage": "collect", "round": self.round, "rotation-seed": self.rotation_seed,
                        "sources": [s for s, _ in pairs], "ciphertexts": [t for _, t in pairs]})

    def unmask(self, survivors: list[int], size: int) -> np.ndarray:
        """The sum of the masks in the survivors' uploads (uint32, mod 2^bits), rebuilt from their shares."""
        self.check(survivors)
        survivors = sorted(set(survivors))
        alive, bits = set(survivors), self.settings.bits
        dropped = self.shared - alive

        def lists(node: int) -> ConfigRecord:
            near = set(self.neighbours[node]) - {node}
            return _record({"active": sorted(near & alive | {node}), "dropped": sorted(near & dropped)})

        shares: dict[int, list[bytes]] = {n: [] for n in self.shared}
        for reply in self._exchange("unmask", lists, survivors).values():
            owners, values = reply.get("owners"), reply.get("shares")
            if isinstance(owners, list) and isinstance(values, list) and len(owners) == len(values):
                for owner, share in zip(owners, values):
                    if owner in shares and isinstance(share, bytes):
                        shares[owner].append(share)
        total = np.zeros(size, dtype=np.uint32)
        for node in sorted(self.shared):
            if len(shares[node]) < self.settings.threshold:
                raise SecAggAborted(f"round {self.round}: secure aggregation aborted at unmask: {len(shares[node])} "
                                    f"shares of node {node}'s secret, threshold={self.settings.threshold}")
            secret = combine_shares(shares[node][: self.settings.threshold])
            if node in alive:
                total += prg_mask(secret, size, bits)
                continue
            private = bytes_to_private_key(secret)
            for j in self.neighbours[node]:
                if j in alive and j != node:  # j added +mask if j > node, -mask otherwise
                    pair = prg_mask(generate_shared_key(private, bytes_to_public_key(self.public_keys[j][0])), size, bits)
                    total += pair if j > node else -pair
        return total & np.uint32((1 << bits) - 1)


def masked_upload(content: RecordDict, size: int, bits: int) -> np.ndarray:
    """The masked vector of a ``collect`` reply: ``size`` values of ``bits`` bits packed as uint8
    (:mod:`~fedprivacy.fl.bit_packing`), returned unpacked as uint32 (else RejectedUpdate)."""
    record = content.array_records.get(SECAGG)
    if not isinstance(record, ArrayRecord) or list(record.keys()) != ["masked"]:
        raise RejectedUpdate("malformed", f"no masked upload (records {sorted(content.keys())})")
    data = _contract_view(record, "masked", ("uint8",))
    if data.shape != (packed_size(size, bits),):
        raise RejectedUpdate("malformed", f"masked upload of shape {data.shape}, expected ({packed_size(size, bits)},):"
                                          f" {size} values of {bits} bits")
    if not padding_is_zero(data, size, bits):
        raise RejectedUpdate("malformed", "masked upload with nonzero bits after its last value")
    return unpack_bits(data, size, bits)


# -- client --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientSettings:
    """What a client's own configuration fixes (never the server's messages): the mechanism it adds noise for."""

    noise_multiplier: float
    clip_norm: float
    expected_cohort: int
    bits: int
    seed: int | None = None
    """None (a device): rounding and noise from the OS; an int: a simulation's seeded stream."""


def _state(context: Context) -> dict[str, Any]:
    record = context.state.config_records.get(STATE)
    out: dict[str, Any] = dict(record) if record is not None else {}
    return out


def _save(context: Context, state: Mapping[str, Any]) -> None:
    context.state.config_records[STATE] = ConfigRecord(dict(state))


def handle(msg: Message, context: Context, settings: ClientSettings,
           train: Callable[[Message, Context], Message]) -> Message:
    """A node's answer to a SecAgg+ message (module docstring); ``train`` answers the ``collect`` stage's
    training with the client's full weights or fedprivacy's delta, against the model in ``msg``."""
    config = msg.content.config_records[SECAGG]
    stage, rnd = config.get("stage"), config.get("round")
    state = _state(context)
    if stage not in STAGES or not isinstance(rnd, int):
        raise ValueError(f"secure aggregation: unknown stage {stage!r} or round {rnd!r}")
    if stage != "setup" and (state.get("round") != rnd or STAGES.index(stage) != STAGES.index(state["stage"]) + 1):
        raise ValueError(f"secure aggregation: stage {stage!r} of round {rnd} after {state.get('stage')!r} of "
                         f"round {state.get('round')}")
    out: dict[str, Any]
    if stage == "setup":
        threshold = config.get("threshold")
        if not isinstance(threshold, int) or threshold < 2:
            raise ValueError(f"secure aggregation: threshold {threshold!r} must be an integer >= 2")
        (sk1, pk1), (sk2, pk2) = generate_key_pairs(), generate_key_pairs()
        state = {"round": rnd, "nid": msg.metadata.dst_node_id, "threshold": threshold,
                 "sk1": private_key_to_bytes(sk1), "sk2": private_key_to_bytes(sk2),
                 "pk1": public_key_to_bytes(pk1), "pk2": public_key_to_bytes(pk2)}
        out = {"pk1": state["pk1"], "pk2": state["pk2"]}
    elif stage == "share-keys":
        out = _share_keys(state, config)
    elif stage == "collect":
        return _collect(msg, context, state, config, settings, train)
    else:
        out = _unmask(state, config)
        del context.state.config_records[STATE]  # the round is over: no secret outlives it
        return Message(RecordDict({SECAGG: _record(out)}), reply_to=msg)
    state["stage"] = stage
    _save(context, state)
    return Message(RecordDict({SECAGG: _record(out)}), reply_to=msg)


def _share_keys(state: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    peers = {int(k): v for k, v in config.items() if k not in ("stage", "round")}
    nid, threshold = state["nid"], state["threshold"]
    if peers.get(nid) != [state["pk1"], state["pk2"]]:
        raise ValueError("secure aggregation: the server did not relay this node's own public keys")
    if len(peers) < threshold:
        raise ValueError(f"secure aggregation: {len(peers)} neighbours, fewer than threshold={threshold}")
    keys = [k for pair in peers.values() for k in pair]
    if len(set(keys)) != len(keys):
        raise ValueError("secure aggregation: two neighbours have the same public key")
    seed = os.urandom(32)
    order = sorted(peers)
    seed_shares = create_shares(seed, threshold, len(order))
    key_shares = create_shares(state["sk1"], threshold, len(order))
    sk2 = bytes_to_private_key(state["sk2"])
    dsts, texts = [], []
    for j, b_share, c_share in zip(order, seed_shares, key_shares):
        if j == nid:
            state["own-seed-share"], state["own-key-share"] = b_share, c_share
            continue
        key = generate_shared_key(sk2, bytes_to_public_key(peers[j][1]))
        dsts.append(j)
        texts.append(encrypt(key, share_keys_plaintext_concat(nid, j, b_share, c_share)))
    state.update({"seed": seed, "peers": order, "peer-pk1": [peers[j][0] for j in order],
                  "peer-pk2": [peers[j][1] for j in order]})
    return {"destinations": dsts, "ciphertexts": texts}


def _collect(msg: Message, context: Context, state: dict[str, Any], config: Mapping[str, Any], settings: ClientSettings,
             train: Callable[[Message, Context], Message]) -> Message:
    nid, peers = state["nid"], state["peers"]
    pk1 = dict(zip(peers, state["peer-pk1"]))
    pk2 = dict(zip(peers, state["peer-pk2"]))
    sk2 = bytes_to_private_key(state["sk2"])
    owners, seed_shares, key_shares = [nid], [state["own-seed-share"]], [state["own-key-share"]]
    for src, text in zip(config.get("sources") or [], config.get("ciphertexts") or []):
        if src not in pk2 or src == nid:
            raise ValueError(f"secure aggregation: a ciphertext from node {src}, not a neighbour")
        actual, dst, b_share, c_share = share_keys_plaintext_separate(
            decrypt(generate_shared_key(sk2, bytes_to_public_key(pk2[src])), text))
        if actual != src or dst != nid:
            raise ValueError(f"secure aggregation: a ciphertext from {actual} to {dst} relayed as from {src} to {nid}")
        owners.append(src)
        seed_shares.append(b_share)
        key_shares.append(c_share)
    if len(owners) < state["threshold"]:
        raise ValueError(f"secure aggregation: {len(owners)} live neighbours, fewer than threshold={state['threshold']}")
    reply = train(msg, context)
    if reply.has_error():
        return reply

    start, layout = record_to_layout(msg.content.array_records["arrays"])
    update = reply_to_update(reply.content, start, layout).to_dense()
    params = SkellamParams(dim=start.numel(), clip_norm=settings.clip_norm, noise_multiplier=settings.noise_multiplier,
                           expected_cohort=settings.expected_cohort, bits=settings.bits)
    rotation = config.get("rotation-seed")
    if not isinstance(rotation, int):
        raise ValueError(f"secure aggregation: rotation seed {rotation!r} is not an integer")
    round_config: Mapping[str, Any] = msg.content.config_records.get("config") or {}
    rng = client_rng(settings.seed, int(round_config.get("server-round", 0)), nid)
    masked = params.encode(update, rotation, rng)
    masked += prg_mask(state["seed"], masked.size, settings.bits)
    sk1 = bytes_to_private_key(state["sk1"])
    for j in owners[1:]:
        pair = prg_mask(generate_shared_key(sk1, bytes_to_public_key(pk1[j])), masked.size, settings.bits)
        masked += pair if nid > j else -pair
    masked &= np.uint32((1 << settings.bits) - 1)
    state.update({"stage": "collect", "owners": owners, "seed-shares": seed_shares, "key-shares": key_shares})
    _save(context, state)
    return Message(RecordDict({SECAGG: arrays_to_record({"masked": pack_bits(masked, settings.bits)})}), reply_to=msg)


def _unmask(state: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    active, dropped = list(config.get("active") or []), list(config.get("dropped") or [])
    owners = state["owners"]
    if set(active) & set(dropped) or not set(active) | set(dropped) <= set(owners):
        raise ValueError("secure aggregation: the unmask lists overlap or name a node that is not a neighbour")
    if len(active) < state["threshold"]:
        raise ValueError(f"secure aggregation: {len(active)} surviving neighbours, fewer than threshold="
                         f"{state['threshold']}")
    seeds = dict(zip(owners, state["seed-shares"]))
    keys = dict(zip(owners, state["key-shares"]))
    return {"owners": active + dropped, "shares": [seeds[n] for n in active] + [keys[n] for n in dropped]}


def is_secagg(msg: Message) -> bool:
    """Whether ``msg`` is a SecAgg+ stage message."""
    return msg.metadata.message_type == "train" and SECAGG in msg.content.config_records


def secure_aggregation_mod(*, noise_multiplier: float, clip_norm: float, expected_cohort: int, bits: int) -> Mod:
    """A mod that answers SecAgg+ for any ClientApp (module docstring): the wrapped app trains in the ``collect``
    stage and replies its full weights (Flower's convention) or fedprivacy's delta; the mod clips it, adds its
    Skellam share from the OS's cryptographic source and sends only the masked vector. Use with
    ``DPFedAvg(placement="distributed", secure_aggregation=...)`` and the same ``z``, ``C``, ``m`` and ``bits``."""
    settings = ClientSettings(noise_multiplier, clip_norm, expected_cohort, bits)

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not is_secagg(msg):
            return call_next(msg, context)
        return handle(msg, context, settings, call_next)

    return mod

