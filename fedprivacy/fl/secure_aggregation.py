r"""SecAgg+ (Bell et al. 2020, arXiv:2009.08722) on Flower's Message API, against a server that departs from the
protocol in the messages it sends (Bonawitz et al. 2017, arXiv:1611.04482, §4: signatures and the ConsistencyCheck
round), carrying the distributed Skellam mechanism (:mod:`fedprivacy.privacy.skellam`): the server learns the sum of
the clients' noisy integer shares modulo :math:`2^b` and nothing else about any one of them.

One round is five exchanges of ``train`` messages, each carrying a ``"secagg"`` ``ConfigRecord`` with its
``stage``:

1. ``setup``: each sampled node checks the announced ``threshold`` and neighbourhood size against its OWN
   configuration (:class:`ClientSettings`), draws two EC key pairs (``c``: masks, ``s``: encryption) and sends the
   public halves with its long-term identity public key and its identity signature over (run, round, its node id,
   the two public keys);
2. ``share-keys``: each node gets its neighbours' public keys (a ring of ``neighbours`` nodes around it in a
   random order, Bell et al.'s k-regular graph), refuses unless there are at most its own ``k`` of them, each
   signature verifies, the identity keys are distinct (and, given a ``roster``, all in it); it draws a self-mask
   seed ``b``, Shamir-shares ``b`` and its mask key ``c_sk`` ``threshold``-of-``neighbours`` and sends each neighbour
   its two shares, encrypted under their ECDH key (the server only forwards ciphertexts);
3. ``collect``: the model and the forwarded shares; the node trains and uploads
   :math:`y_i = v_i + \mathrm{PRG}(b_i) + \sum_{j} \pm \mathrm{PRG}(c_{ij}) \bmod 2^b`, with :math:`v_i` its
   Skellam share (:meth:`~fedprivacy.privacy.skellam.SkellamParams.encode`) and the sign ``+`` if
   :math:`i > j`; each pairwise mask cancels in the sum of two survivors; the upload travels as ``b`` bits per
   coordinate (:mod:`~fedprivacy.fl.bit_packing`);
4. ``consistency``: the server sends each survivor the survivor set ``U`` (the nodes whose upload it accepted);
   the node refuses a ``U`` without itself or with fewer than ``threshold`` of its neighbours, and signs (run,
   round, its mask key, sorted ``U``) with its identity key; it signs once per round (the stages' order admits no
   second ``consistency`` message);
5. ``unmask``: the node gets its lists and the consistency signatures of its neighbours; it reveals only if at
   least ``threshold`` distinct neighbours (itself included) signed the ``U`` it signed, and its lists are exactly
   ``active`` = (its neighbours who shared keys with it) ∩ ``U`` and ``dropped`` = the rest of them: the share of
   ``b`` for each active neighbour, of ``c_sk`` for each dropped one (never both for one node); with ``threshold``
   shares the server removes the survivors' self masks and the dropped nodes' pairwise masks.

What this reaches, against a server that may send any messages (it still runs no client) and ``c`` clients that
collude with it. Node X shares its secrets ``b_X`` and ``c_sk_X`` among the set :math:`N_X` of peers it received
(itself included; :math:`|N_X| \le k` by its own check), ``threshold``-of-:math:`|N_X|`; an honest holder reveals
at most one of X's two shares (its lists are disjoint), a colluding holder both. Rebuilding both needs ``t`` shares
of each, i.e. :math:`t - c` honest holders for ``b`` and :math:`t - c` others for ``c_sk`` among the
:math:`|N_X| - c` honest ones: :math:`2(t - c) \le |N_X| - c`. So no node's two secrets are both revealed when
:math:`2t > k + c` (with honest clients, :math:`2t > k`; enforced by :class:`SecureAggregation` and
:class:`ClientSettings`): the server then never removes an honest survivor's self mask and its pairwise masks
together. The consistency round adds that every honest client reveals only under the one ``U`` it signed, that
contains it, and that ``t`` of its neighbours signed (at least ``t - c`` honest ones, each signing once): when the
neighbourhoods are the whole cohort of ``n`` (``k >= n``) and :math:`2t > n + c`, two different ``U`` cannot both
gather ``t`` signatures, so all honest clients reveal under one ``U`` and the server unmasks the sum over ``U``
only (Bonawitz et al. §4). On a ring (``k < n``) the signatures bind each client's view to its own
neighbourhood's; agreement across distant parts of the ring is not claimed here. Signatures bind the keys of one
round to one identity key per node; only a ``roster`` of trusted identity keys (given out of band; in a
deployment, the SuperNodes' authentication keys) stops a server that invents clients (Sybils) or substitutes its
own keys for a client's: without one, such a server can unmask a client.

Primitives are Flower's own (``flwr.common.secure_aggregation`` and ``flwr.supercore.primitives``): ECDH key
agreement with HKDF, Fernet authenticated encryption, Shamir sharing, ECDSA P-384 signatures. The masks' PRG is
AES-256 in counter mode (``cryptography``) keyed with SHA-256 of the seed, not Flower's ``pseudo_rand_gen``, which
folds its seed into 32 bits (a server could search all 2^32 masks).

Failure: a node that answers a stage with an error, a malformed reply or nothing is logged (one WARNING per stage
naming the nodes and the reasons) and counted (:meth:`SecAggRound.failure_metrics`); below ``threshold`` survivors
at any stage, or too few shares to unmask, the round raises :class:`SecAggAborted`; the strategy logs one line and
releases and accounts nothing, except when it fails during ``consistency`` or ``unmask``, after the release was
logged ahead: that release stays accounted (over-counting, never under-counting).
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
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_utils import (share_keys_plaintext_concat,
                                                             share_keys_plaintext_separate)
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import (bytes_to_private_key, bytes_to_public_key, generate_key_pairs,
                                                  private_key_to_bytes, public_key_to_bytes, sign_message,
                                                  verify_signature)

from fedprivacy.fl.bit_packing import pack_bits, packed_size, padding_is_zero, unpack_bits
from fedprivacy.fl.records import _contract_view, arrays_to_record, reply_to_update, record_to_layout
from fedprivacy.privacy.skellam import SkellamParams, client_rng
from fedprivacy.updates import RejectedUpdate


log = logging.getLogger(__name__)

SECAGG = "secagg"
"""The ``ConfigRecord`` of every SecAgg+ message (its ``stage``) and the masked upload's ``ArrayRecord`` key."""
STATE = "fedprivacy-secagg"
"""``Context.state`` key of a node's protocol state (deleted when its round ends)."""
IDENTITY = "fedprivacy-secagg-identity"
"""``Context.state`` key of a node's long-term identity signing key (created once, when none is given)."""
STAGES = ("setup", "share-keys", "collect", "consistency", "unmask")


class SecAggAborted(RuntimeError):
    """The round cannot complete (too few survivors or shares); nothing of it is released."""


def check_parameters(threshold: Any, neighbours: Any, what: str) -> None:
    """ValueError naming ``what`` unless ``2 <= threshold <= neighbours``, ``neighbours`` odd and ``2 threshold >
    neighbours`` (module docstring: no node's two secrets can both be revealed by honest holders)."""
    if not (type(threshold) is int and type(neighbours) is int and 2 <= threshold <= neighbours):
        raise ValueError(f"{what} needs integers 2 <= threshold <= neighbours, got threshold={threshold!r}, "
                         f"neighbours={neighbours!r}")
    if neighbours % 2 == 0:
        raise ValueError(f"{what}: neighbours must be odd (a node and k/2 on each side), got {neighbours}")
    if not 2 * threshold > neighbours:
        raise ValueError(f"{what} needs 2 * threshold > neighbours (else a server lying about dropouts can rebuild "
                         f"both secrets of a node), got threshold={threshold}, neighbours={neighbours}")


@dataclass(frozen=True)
class SecureAggregation:
    """SecAgg+'s parameters.

    Attributes:
        threshold: t, the shares needed to rebuild a node's secrets (and the fewest survivors a round completes
            with); more than half of ``neighbours`` and at most ``neighbours``.
        neighbours: k, the size of each node's neighbourhood, itself included (odd; the whole cohort if larger).
        bits: b, the modulus ``2^b`` of the masked shares (:class:`~fedprivacy.privacy.skellam.SkellamParams`).
        timeout: seconds each stage waits for replies (None: until every node answered or was reported gone).
    """

    threshold: int
    neighbours: int
    bits: int = 20
    timeout: float | None = None

    def __post_init__(self) -> None:
        check_parameters(self.threshold, self.neighbours, "secure aggregation")


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


def _transcript(label: bytes, *parts: int | bytes) -> bytes:
    """What a signature covers: ``label`` and ``parts``, each length-prefixed (no two tuples encode alike)."""
    out = [label]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out += [len(data).to_bytes(8, "big"), data]
    return b"".join(out)


def keys_transcript(run: int, rnd: int, node: int, pk1: bytes, pk2: bytes) -> bytes:
    """What a node signs in ``setup``: its two public keys of round ``rnd`` of run ``run``."""
    return _transcript(b"fedprivacy-secagg-keys", run, rnd, node, pk1, pk2)


def survivors_transcript(run: int, rnd: int, pk1: bytes, survivors: Iterable[int]) -> bytes:
    """What a node signs in ``consistency``: the survivor set of the round in which its mask key is ``pk1``."""
    return _transcript(b"fedprivacy-secagg-survivors", run, rnd, pk1, *sorted(survivors))


def public_key(data: Any, what: str) -> ec.EllipticCurvePublicKey:
    """The EC public key in PEM ``data``, else ValueError naming ``what``."""
    try:
        key = bytes_to_public_key(data) if isinstance(data, bytes) else None
    except (ValueError, TypeError, UnsupportedAlgorithm):
        key = None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError(f"secure aggregation: {what} is not a PEM EC public key")
    return key


def _verifies(key: ec.EllipticCurvePublicKey, message: bytes, signature: Any) -> bool:
    return isinstance(signature, bytes) and verify_signature(key, message, signature)


# -- server ------------------------------------------------------------------------------------------------
@dataclass
class SecAggRound:
    """The server's side of one round (module docstring): run :meth:`prepare` (setup, share keys), send
    :meth:`collect_content` with the model, then :meth:`unmask` the survivors' sum (its consistency round first).
    Each stage's message content comes from one ``*_content`` method."""

    grid: Grid
    settings: SecureAggregation
    round: int
    rotation_seed: int
    nodes: list[int]
    neighbours: dict[int, list[int]] = field(default_factory=dict)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    identities: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    forwarded: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    shared: set[int] = field(default_factory=set)
    sent_survivors: dict[int, list[int]] = field(default_factory=dict)
    signatures: dict[int, bytes] = field(default_factory=dict)
    failed: dict[str, dict[int, str]] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)
    run_id: int = 0
    """The run of the messages sent (what the signatures cover), from the first one."""

    def _exchange(self, stage: str, content: Callable[[int], ConfigRecord], nodes: Iterable[int]) -> dict[int, ConfigRecord]:
        """Send ``stage`` to ``nodes``; the replies without an error, by node (anything else is a failure)."""
        def message(node: int) -> Message:
            record = content(node)
            record["stage"], record["round"] = stage, self.round
            msg = Message(RecordDict({SECAGG: record}), dst_node_id=node, message_type="train",
                          group_id=f"{self.round}-{stage}")
            self.run_id = msg.metadata.run_id
            return msg

        nodes = list(nodes)
        out: dict[int, ConfigRecord] = {}
        for reply in self.grid.send_and_receive([message(n) for n in nodes], timeout=self.settings.timeout):
            node = reply.metadata.src_node_id
            if node not in nodes or node in out or node in self.failed.get(stage, {}):
                continue  # not asked, or answered already: its first answer stands
            if reply.has_error():
                self.fail(stage, node, reply.error.reason or "error reply")
            elif SECAGG not in reply.content.config_records:
                self.fail(stage, node, "no secagg record")
            else:
                out[node] = reply.content.config_records[SECAGG]
        for node in nodes:
            if node not in out:
                self.fail(stage, node, "no reply")
        return out

    def fail(self, stage: str, node: int, reason: str) -> None:
        """Record that ``node`` failed ``stage`` (its first reason is kept); :meth:`report` logs them."""
        self.failed.setdefault(stage, {}).setdefault(node, reason)

    def report(self, stage: str) -> None:
        """One WARNING naming the nodes that failed ``stage`` and why (once per stage)."""
        failed = self.failed.get(stage)
        if failed and stage not in self.reported:
            self.reported.add(stage)
            log.warning("round %d: secure aggregation: %d node(s) failed at %s: %s", self.round, len(failed), stage,
                        "; ".join(f"node {n}: {reason}" for n, reason in sorted(failed.items())))

    def failure_metrics(self) -> dict[str, float]:
        """``secagg_failed_<stage>``: how many nodes failed each stage (0 for a stage none failed or not reached)."""
        return {f"secagg_failed_{stage.replace('-', '_')}": float(len(self.failed.get(stage, {}))) for stage in STAGES}

    def dropped_before_upload(self) -> int:
        """How many sampled nodes failed before their masked upload (setup, share-keys or collect)."""
        return len({n for stage in STAGES[:3] for n in self.failed.get(stage, {})})

    def check(self, survivors: Iterable[int]) -> None:
        """SecAggAborted unless every survivor and every node that dropped after sharing its keys keeps at least
        ``threshold`` surviving neighbours (whose shares the unmasking needs)."""
        alive = set(survivors)
        self._check("collect", alive, self.shared)

    def _check(self, stage: str, alive: Iterable[int], nodes: Iterable[int] | None = None) -> list[int]:
        self.report(stage)
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

    def setup_content(self, node: int) -> ConfigRecord:
        """``setup``: the threshold and the size of ``node``'s neighbourhood."""
        return ConfigRecord({"threshold": self.settings.threshold, "neighbours": len(self.neighbours[node])})

    def keys_content(self, node: int, alive: Iterable[int]) -> ConfigRecord:
        """``share-keys``: each live neighbour's two public keys, identity key and signature."""
        return ConfigRecord({str(j): [*self.public_keys[j], *self.identities[j]]
                             for j in self.neighbours[node] if j in set(alive)})

    def consistency_content(self, node: int, survivors: list[int]) -> ConfigRecord:
        """``consistency``: the survivor set U."""
        return ConfigRecord({"survivors": list(survivors)})

    def unmask_content(self, node: int, survivors: list[int], signers: Iterable[int]) -> ConfigRecord:
        """``unmask``: ``node``'s active and dropped neighbours under the survivor set it was sent, and its
        neighbours' consistency signatures."""
        near, alive = set(self.neighbours[node]), set(survivors)
        signed = sorted(near & set(signers))
        return _record({"active": sorted(near & alive), "dropped": sorted(near & self.shared - alive),
                        "signers": signed, "signatures": [self.signatures[j] for j in signed]})

    def prepare(self) -> list[int]:
        """Setup and share keys; returns the nodes that will get the model (SecAggAborted below threshold)."""
        self.neighbours = _ring(self.nodes, self.settings.neighbours, random.SystemRandom())
        setup = self._exchange("setup", self.setup_content, self.nodes)
        for node, reply in setup.items():
            keys = (reply.get("pk1"), reply.get("pk2"))
            identity = (reply.get("identity"), reply.get("signature"))
            try:
                for i, key in enumerate(keys):
                    public_key(key, f"public key {i + 1}")
                if not _verifies(public_key(identity[0], "identity key"),
                                 keys_transcript(self.run_id, self.round, node, *keys), identity[1]):  # type: ignore[arg-type]
                    raise ValueError("secure aggregation: the keys' signature does not verify")
            except ValueError as err:
                self.fail("setup", node, str(err))
                continue
            self.public_keys[node], self.identities[node] = keys, identity  # type: ignore[assignment]
        alive = self._check("setup", self.public_keys)
        shared = self._exchange("share-keys", lambda n: self.keys_content(n, alive), alive)
        self.forwarded = {n: [] for n in alive}
        for src, reply in shared.items():
            dsts, texts = reply.get("destinations"), reply.get("ciphertexts")
            if not (isinstance(dsts, list) and isinstance(texts, list) and len(dsts) == len(texts)):
                self.fail("share-keys", src, "malformed ciphertexts")
                continue
            for dst, text in zip(dsts, texts):
                if dst in self.forwarded and dst in self.neighbours[src] and isinstance(text, bytes):
                    self.forwarded[dst].append((src, text))
        self.shared = set(self._check("share-keys", set(shared) - set(self.failed.get("share-keys", {}))))
        return sorted(self.shared)

    def collect_content(self, node: int) -> ConfigRecord:
        """The ``secagg`` record of ``node``'s ``collect`` message: its neighbours' ciphertexts, the rotation seed."""
        pairs = [(src, text) for src, text in self.forwarded[node] if src in self.shared]
        return _record({"stage": "collect", "round": self.round, "rotation-seed": self.rotation_seed,
                        "sources": [s for s, _ in pairs], "ciphertexts": [t for _, t in pairs]})

    def consistency(self, survivors: list[int]) -> list[int]:
        """The consistency round: each survivor signs U = ``survivors``; returns the signers whose signature over
        the set they were sent verifies (SecAggAborted below ``threshold``)."""
        sent = {n: self.consistency_content(n, survivors) for n in survivors}
        self.sent_survivors = {n: list(record["survivors"]) for n, record in sent.items()}  # type: ignore[arg-type]
        for node, reply in self._exchange("consistency", sent.__getitem__, survivors).items():
            signature = reply.get("signature")
            if _verifies(public_key(self.identities[node][0], "identity key"), survivors_transcript(
                    self.run_id, self.round, self.public_keys[node][0], self.sent_survivors[node]), signature):
                self.signatures[node] = signature  # type: ignore[assignment]
            else:
                self.fail("consistency", node, "no valid signature over the survivor set")
        return self._check("consistency", self.signatures)

    def unmask(self, survivors: list[int], size: int) -> np.ndarray:
        """The sum of the masks in the survivors' uploads (uint32, mod 2^bits), rebuilt from their shares after
        the consistency round."""
        self.check(survivors)
        survivors = sorted(set(survivors))
        signers = self.consistency(survivors)
        alive, bits = set(survivors), self.settings.bits
        seeds: dict[int, list[bytes]] = {n: [] for n in alive}
        keys: dict[int, list[bytes]] = {n: [] for n in self.shared - alive}
        for node, reply in self._exchange("unmask", lambda n: self.unmask_content(n, self.sent_survivors[n], signers),
                                          signers).items():
            for kind, shares in (("seed", seeds), ("key", keys)):
                owners, values = reply.get(f"{kind}-owners"), reply.get(f"{kind}-shares")
                if isinstance(owners, list) and isinstance(values, list) and len(owners) == len(values):
                    for owner, share in zip(owners, values):
                        if owner in shares and isinstance(share, bytes):
                            shares[owner].append(share)
        self.report("unmask")
        total = np.zeros(size, dtype=np.uint32)
        for node in sorted(self.shared):
            got = seeds[node] if node in alive else keys[node]
            if len(got) < self.settings.threshold:
                raise SecAggAborted(f"round {self.round}: secure aggregation aborted at unmask: {len(got)} "
                                    f"shares of node {node}'s secret, threshold={self.settings.threshold}")
            try:
                secret = combine_shares(got[: self.settings.threshold])
                private = None if node in alive else bytes_to_private_key(secret)
            except (ValueError, TypeError, UnsupportedAlgorithm) as err:
                raise SecAggAborted(f"round {self.round}: secure aggregation aborted at unmask: node {node}'s shares do "
                                    f"not combine ({err})") from None
            if private is None:
                total += prg_mask(secret, size, bits)
                continue
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
    """What a client's own configuration fixes (never the server's messages): the mechanism it adds noise for and
    the protocol's parameters it accepts (module docstring)."""

    noise_multiplier: float
    clip_norm: float
    expected_cohort: int
    bits: int
    threshold: int
    """t: the only threshold this node accepts from the server (``2 t > neighbours``)."""
    neighbours: int
    """k: the largest neighbourhood this node shares its secrets in."""
    seed: int | None = None
    """None (a device): rounding and noise from the OS; an int: a simulation's seeded stream."""
    roster: frozenset[bytes] | None = None
    """The identity public keys (PEM) of the nodes this node accepts as neighbours, given out of band; None: any
    key (module docstring: then a server can invent clients or substitute keys)."""
    identity_key: bytes | None = None
    """This node's identity signing key (PEM EC private key); None: one created once in its ``Context.state``."""

    def __post_init__(self) -> None:
        check_parameters(self.threshold, self.neighbours, "this node's secure aggregation")
        if self.identity_key is not None:
            try:
                key = bytes_to_private_key(self.identity_key)
            except (ValueError, TypeError, UnsupportedAlgorithm):
                key = None
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError("secure aggregation: identity_key is not a PEM EC private key")
        if self.roster is not None:
            object.__setattr__(self, "roster", frozenset(
                public_key_to_bytes(public_key(k, "a roster entry")) for k in self.roster))


def _state(context: Context) -> dict[str, Any]:
    record = context.state.config_records.get(STATE)
    out: dict[str, Any] = dict(record) if record is not None else {}
    return out


def _save(context: Context, state: Mapping[str, Any]) -> None:
    context.state.config_records[STATE] = ConfigRecord(dict(state))


def _identity(context: Context, settings: ClientSettings) -> ec.EllipticCurvePrivateKey:
    """The node's identity signing key: ``settings.identity_key``, else the one kept in its ``Context.state``."""
    if settings.identity_key is not None:
        return bytes_to_private_key(settings.identity_key)  # type: ignore[no-any-return]
    record = context.state.config_records.get(IDENTITY)
    if record is None:
        record = ConfigRecord({"key": private_key_to_bytes(generate_key_pairs()[0])})
        context.state.config_records[IDENTITY] = record
    return bytes_to_private_key(record["key"])  # type: ignore[arg-type, no-any-return]


def handle(msg: Message, context: Context, settings: ClientSettings,
           train: Callable[[Message, Context], Message]) -> Message:
    """A node's answer to a SecAgg+ message (module docstring); ``train`` answers the ``collect`` stage's
    training with the client's full weights or fedprivacy's delta, against the model in ``msg``. A message this
    node refuses raises ValueError (its reply is an error: the server drops it)."""
    config = msg.content.config_records[SECAGG]
    stage, rnd = config.get("stage"), config.get("round")
    state = _state(context)
    if stage not in STAGES or not isinstance(rnd, int):
        raise ValueError(f"secure aggregation: unknown stage {stage!r} or round {rnd!r}")
    if stage != "setup" and (state.get("round") != rnd or STAGES.index(stage) != STAGES.index(state["stage"]) + 1):
        raise ValueError(f"secure aggregation: stage {stage!r} of round {rnd} after {state.get('stage')!r} of "
                         f"round {state.get('round')}")
    run = msg.metadata.run_id
    out: dict[str, Any]
    if stage == "setup":
        state, out = _setup(rnd, msg.metadata.dst_node_id, run, config, settings, _identity(context, settings))
    elif stage == "share-keys":
        out = _share_keys(state, config, settings, run)
    elif stage == "collect":
        return _collect(msg, context, state, config, settings, train)
    elif stage == "consistency":
        out = _consistency(state, config, run, _identity(context, settings))
    else:
        out = _unmask(state, config, run)
        del context.state.config_records[STATE]  # the round is over: no secret outlives it
        return Message(RecordDict({SECAGG: _record(out)}), reply_to=msg)
    state["stage"] = stage
    _save(context, state)
    return Message(RecordDict({SECAGG: _record(out)}), reply_to=msg)


def _setup(rnd: int, nid: int, run: int, config: Mapping[str, Any], settings: ClientSettings,
           identity: ec.EllipticCurvePrivateKey) -> tuple[dict[str, Any], dict[str, Any]]:
    threshold, size = config.get("threshold"), config.get("neighbours")
    if threshold != settings.threshold:
        raise ValueError(f"secure aggregation: the server announced threshold={threshold!r}; this node's threshold "
                         f"setting is {settings.threshold}")
    if type(size) is not int or not settings.threshold <= size <= settings.neighbours:
        raise ValueError(f"secure aggregation: the server announced a neighbourhood of {size!r} nodes; this node's "
                         f"settings allow threshold={settings.threshold} to neighbours={settings.neighbours}")
    (sk1, pk1), (sk2, pk2) = generate_key_pairs(), generate_key_pairs()
    state: dict[str, Any] = {"round": rnd, "nid": nid, "threshold": settings.threshold,
                             "sk1": private_key_to_bytes(sk1), "sk2": private_key_to_bytes(sk2),
                             "pk1": public_key_to_bytes(pk1), "pk2": public_key_to_bytes(pk2),
                             "identity": public_key_to_bytes(identity.public_key())}
    state["signature"] = sign_message(identity, keys_transcript(run, rnd, nid, state["pk1"], state["pk2"]))
    return state, {k: state[k] for k in ("pk1", "pk2", "identity", "signature")}


def _share_keys(state: dict[str, Any], config: Mapping[str, Any], settings: ClientSettings, run: int) -> dict[str, Any]:
    nid, threshold = state["nid"], state["threshold"]
    peers: dict[int, list[bytes]] = {}
    for name, value in config.items():
        if name in ("stage", "round"):
            continue
        if not (name.isdigit() and isinstance(value, list) and len(value) == 4
                and all(isinstance(v, bytes) for v in value)):
            raise ValueError(f"secure aggregation: neighbour {name!r}'s entry is not four keys and signatures")
        peers[int(name)] = value
    if peers.get(nid) != [state[k] for k in ("pk1", "pk2", "identity", "signature")]:
        raise ValueError("secure aggregation: the server did not relay this node's own keys")
    if not threshold <= len(peers) <= settings.neighbours:
        raise ValueError(f"secure aggregation: {len(peers)} neighbours sent; this node's settings allow threshold="
                         f"{threshold} to neighbours={settings.neighbours}")
    identities = []
    for j, (pk1, pk2, identity, signature) in sorted(peers.items()):
        key = public_key(identity, f"node {j}'s identity key")
        canonical = public_key_to_bytes(key)
        if settings.roster is not None and canonical not in settings.roster:
            raise ValueError(f"secure aggregation: node {j}'s identity key is not in this node's roster")
        if not verify_signature(key, keys_transcript(run, state["round"], j, pk1, pk2), signature):
            raise ValueError(f"secure aggregation: node {j}'s keys are not signed by its identity key")
        public_key(pk1, f"node {j}'s public key 1")
        public_key(pk2, f"node {j}'s public key 2")
        identities.append(canonical)
    if len(set(identities)) != len(identities):
        raise ValueError("secure aggregation: two neighbours have the same identity key")
    keys = [k for pair in peers.values() for k in pair[:2]]
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
        shared_key = generate_shared_key(sk2, bytes_to_public_key(peers[j][1]))
        dsts.append(j)
        texts.append(encrypt(shared_key, share_keys_plaintext_concat(nid, j, b_share, c_share)))
    state.update({"seed": seed, "peers": order, "peer-pk1": [peers[j][0] for j in order],
                  "peer-pk2": [peers[j][1] for j in order], "peer-identity": identities})
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


def _consistency(state: dict[str, Any], config: Mapping[str, Any], run: int,
                 identity: ec.EllipticCurvePrivateKey) -> dict[str, Any]:
    survivors = config.get("survivors")
    if not (isinstance(survivors, list) and all(type(n) is int for n in survivors)
            and len(set(survivors)) == len(survivors)):
        raise ValueError("secure aggregation: the survivor set is not a list of distinct node ids")
    nid, alive, owners = state["nid"], set(survivors), set(state["owners"])
    if nid not in alive:
        raise ValueError("secure aggregation: the survivor set leaves out this node itself (it uploaded)")
    if not alive & set(state["peers"]) <= owners:
        raise ValueError("secure aggregation: the survivor set names a neighbour that never shared keys with this node")
    if len(alive & owners) < state["threshold"]:
        raise ValueError(f"secure aggregation: {len(alive & owners)} surviving neighbours, fewer than threshold="
                         f"{state['threshold']}")
    state["survivors"] = sorted(alive)
    return {"signature": sign_message(identity, survivors_transcript(run, state["round"], state["pk1"], alive))}


def _unmask(state: dict[str, Any], config: Mapping[str, Any], run: int) -> dict[str, Any]:
    """The shares this node reveals: for its neighbours in the survivor set it signed, of ``b``; for the others
    that shared keys with it, of ``c_sk``; only if the lists are exactly those and ``threshold`` neighbours signed
    the same set."""
    alive, owners = set(state["survivors"]), state["owners"]
    active = sorted(set(owners) & alive)
    dropped = sorted(set(owners) - alive)
    if config.get("active", []) != active or config.get("dropped", []) != dropped:
        raise ValueError(f"secure aggregation: the unmask lists are not the signed survivor set's (active {active}, "
                         f"dropped {dropped})")
    signers, signatures = config.get("signers", []), config.get("signatures", [])
    if not (isinstance(signers, list) and isinstance(signatures, list) and len(signers) == len(signatures)):
        raise ValueError("secure aggregation: malformed consistency signatures")
    identities = dict(zip(state["peers"], state["peer-identity"]))
    pk1 = dict(zip(state["peers"], state["peer-pk1"]))
    valid = {j for j, signature in zip(signers, signatures)
             if j in identities and _verifies(bytes_to_public_key(identities[j]),
                                              survivors_transcript(run, state["round"], pk1[j], alive), signature)}
    if len(valid) < state["threshold"]:
        raise ValueError(f"secure aggregation: {len(valid)} neighbours signed the survivor set this node signed, "
                         f"fewer than threshold={state['threshold']}")
    seeds = dict(zip(owners, state["seed-shares"]))
    keys = dict(zip(owners, state["key-shares"]))
    return {"seed-owners": active, "seed-shares": [seeds[n] for n in active],
            "key-owners": dropped, "key-shares": [keys[n] for n in dropped]}


def is_secagg(msg: Message) -> bool:
    """Whether ``msg`` is a SecAgg+ stage message."""
    return msg.metadata.message_type == "train" and SECAGG in msg.content.config_records


def secure_aggregation_mod(*, noise_multiplier: float, clip_norm: float, expected_cohort: int, bits: int,
                           threshold: int, neighbours: int, roster: Iterable[bytes] | None = None,
                           identity_key: bytes | None = None) -> Mod:
    """A mod that answers SecAgg+ for any ClientApp (module docstring): the wrapped app trains in the ``collect``
    stage and replies its full weights (Flower's convention) or fedprivacy's delta; the mod clips it, adds its
    Skellam share from the OS's cryptographic source and sends only the masked vector. Use with
    ``DPFedAvg(placement="distributed", secure_aggregation=SecureAggregation(threshold, neighbours, bits))`` and
    the same ``z``, ``C``, ``m``, ``bits``, ``threshold`` and ``neighbours`` (the node refuses any other threshold
    or a larger neighbourhood). ``roster``: the identity public keys (PEM) of the nodes it accepts as neighbours;
    ``identity_key``: its own identity signing key (PEM; default: one created once in each node's
    ``Context.state``), e.g. read from the file its node config names (:class:`ClientSettings`)."""
    settings = ClientSettings(noise_multiplier, clip_norm, expected_cohort, bits, threshold, neighbours,
                              roster=None if roster is None else frozenset(roster), identity_key=identity_key)

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not is_secagg(msg):
            return call_next(msg, context)
        return handle(msg, context, settings, call_next)

    return mod
