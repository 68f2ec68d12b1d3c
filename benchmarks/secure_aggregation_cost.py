"""Secure aggregation (SecAgg+ carrying distributed Skellam noise): seconds and bytes per client per round against
the plaintext distributed placement, and where the time goes.

The protocol of :mod:`fedprivacy.fl.secure_aggregation` runs in this process without Flower's network: a
:class:`LocalGrid` (``send_and_receive`` only, the one call :class:`~fedprivacy.fl.secure_aggregation.SecAggRound`
makes) hands each message to its node's :func:`~fedprivacy.fl.secure_aggregation.handle` (one ``Context`` per
node, kept across the five stages) and returns the replies. The server's side is the strategy's: ``prepare()``
(setup, share-keys), the ``collect`` messages (``arrays``: the broadcast model, ``config``: ``server-round``,
``secagg``: ``collect_content(node)``), :func:`~fedprivacy.fl.secure_aggregation.masked_upload` summed by
:class:`~fedprivacy.privacy.secure_mechanism.SecureSum`, ``check``, then ``SecureSum.release`` (``unmask``: Shamir
reconstruction and the PRG masks; ``decode``; divide by m). Each client "trains" with a stub that replies its full
weights, the broadcast plus a fixed random delta of L2 norm 0.5-2 C (6 of 10 clipped); the stub's time is
"training" and left out of both paths.

Above ``--replay-above`` values (default 1,000,000: the 5,000,500 model), a round still runs the whole cohort
through the protocol, but only ``--timed-clients`` of them (default 3, a different 3 each repetition) compute
their Skellam share and are timed; the others send a copy of a real precomputed share (each shifted cyclically by
its own offset, :func:`replayed_shares`), masked as usual (keys,
Shamir shares, ciphertexts, masks, messages all real): the server's work is the full cohort's and a round costs 3
encodes instead of 10 (the default run then takes about 2 minutes instead of 3-6). Their released sum is not the
workload's (the correctness check covers that); the dropout rounds replay every share.

Baseline, measured in the same run (interleaved: each repetition runs both paths, the order alternating): the
plaintext distributed placement as the ClientApp mod that implements it
(:func:`~fedprivacy.fl.mods.client_noise_mod`, ``placement="distributed"``: decode the reply, ``noised_upload`` =
clip + ``N(0, z^2 C^2 / m)`` over the dense update, a float32 upload of d values), around the same stub; its
server decodes each reply and sums it (``PrivateSum``, placement distributed: no clip, no noise when all m arrive,
the top-up draw when one is missing).

- **seconds per client per round**: a client's time over all five stages (its handler's wall time minus the
  stub), averaged over the cohort; per repetition, and its ratio to the plaintext mod's in the same repetition;
  median [min, max] over ``--repeat`` repetitions.
- **where the time goes**: the protocol's primitives are wrapped with timers while it runs (their names in
  ``fedprivacy.fl.secure_aggregation`` and ``SkellamParams.encode/decode``; the library's files are untouched),
  charged to the side and stage running them; "other" is the stage's wall time minus its timed parts. The
  client's encode and a mask are ALSO timed by calling ``SkellamParams.encode`` and ``prg_mask`` directly, step by
  step (clip, rotate, scale, rounding, Skellam noise, wrap; AES-CTR keystream, conversion), with the steps'
  result asserted equal to ``encode``'s and ``prg_mask``'s.
- **bytes per client per round**: what each message and reply carries (``ArrayRecord.count_bytes()``: ``.npy``
  payloads with their headers and the keys; ``ConfigRecord.count_bytes()``'s rule, 8 bytes per number, the
  length of each bytes/str, the keys), per stage. Flower's framing (protobuf, gRPC) is not counted on either side.
- **one dropout**: in each repetition, one more round in which one node sends setup and share-keys, then no collect
  reply: the server rebuilds its mask key from the survivors' shares and removes its pairwise masks from each
  surviving neighbour; compared with the repetition's round without a dropout.
- **kernel time**: the system CPU seconds and minor page faults inside the direct encode, decode and noised_upload
  (a model-sized temporary above glibc's mmap threshold is mapped fresh, and zeroed by the kernel, each time).
- **correctness** (asserted first, at the small size and ``z = 0``): the released sum equals the sum of the
  clients' clipped updates within ``SkellamParams.rounding_error_bound(n)``, with and without a dropout.

    python benchmarks/secure_aggregation_cost.py [--sizes 5000500 100050] [--clients 10] [--neighbours 5]
        [--threshold 3] [--bits 20] [--clip-norm 1] [--noise-multiplier 1] [--repeat 3] [--threads 1]
        [--replay-above 1000000] [--timed-clients 3] [--quick]

torch runs on ``--threads`` threads (default 1: a client has one core here, and numpy's draws and AES are
single-threaded either way). ``--quick``: sizes 100,050 and 10,000, 2 repetitions (15-45 s).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from machine import machine_line  # this folder (the script's) is on sys.path
import fedprivacy.fl.secure_aggregation as sa
from fedprivacy.fl.mods import client_noise_mod, noised_upload
from fedprivacy.fl.records import layout_to_record, record_to_layout, reply_to_update
from fedprivacy.fl.secure_aggregation import (ClientSettings, SecAggRound, SecureAggregation, handle,
                                              masked_upload, prg_mask)
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.placement import client_noise_std
from fedprivacy.privacy.secure_mechanism import SecureSum
from fedprivacy.privacy.skellam import SkellamParams, client_rng, conditional_rounding, rotate, unrotate
from fedprivacy.updates import SparseUpdate

STUB = "training stub (excluded)"
SA_TIMED = {  # names in fedprivacy.fl.secure_aggregation -> what the tables call them
    "generate_key_pairs": "EC key generation", "private_key_to_bytes": "key (de)serialization",
    "public_key_to_bytes": "key (de)serialization", "bytes_to_private_key": "key (de)serialization",
    "bytes_to_public_key": "key (de)serialization", "create_shares": "Shamir: share", "combine_shares": "Shamir: combine",
    "generate_shared_key": "ECDH + HKDF", "encrypt": "Fernet: encrypt", "decrypt": "Fernet: decrypt",
    "prg_mask": "PRG masks (AES-CTR)", "record_to_layout": "read model + reply", "reply_to_update": "read model + reply",
    "arrays_to_record": "upload record", "pack_bits": "pack upload (b bits each)", "unpack_bits": "unpack upload",
    "sign_message": "ECDSA sign (identity)", "verify_signature": "ECDSA verify (identity)",
}
ADDED = ("ECDSA sign (identity)", "ECDSA verify (identity)")
"""The client's operations that the protocol against a lying server adds (with its consistency stage)."""


# -- timing and bytes ----------------------------------------------------------------------------------------
class Meter:
    """Seconds and calls per (label..., op); ``label`` is who runs now (set by :meth:`on`)."""

    def __init__(self) -> None:
        self.label: tuple = ("idle",)
        self.seconds: dict[tuple, float] = defaultdict(float)
        self.calls: dict[tuple, int] = defaultdict(int)

    @contextlib.contextmanager
    def on(self, *label):
        prev, self.label = self.label, label
        try:
            yield
        finally:
            self.label = prev

    def add(self, op: str, seconds: float, label: tuple | None = None) -> None:
        key = (*(self.label if label is None else label), op)
        self.seconds[key] += seconds
        self.calls[key] += 1

    def wrap(self, op: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(op, time.perf_counter() - t0)
        return timed


def replayed_shares(share: np.ndarray, nodes: list[int]) -> dict[int, np.ndarray]:
    """Each replaying node's copy of the precomputed share, cyclically shifted by an offset of its own: coordinate by
    coordinate the copies' Skellam noise is then independent across nodes (it is iid over coordinates), as real
    shares' is. Identical copies would add up coherently and the server's integrity check would (rightly) refuse
    their sum as larger than honest clients can make it."""
    return {n: np.roll(share, 1 + 104_729 * i) for i, n in enumerate(nodes)}


@contextlib.contextmanager
def instrumented(meter: Meter, replay: dict[int, np.ndarray] | None = None):
    """Wrap the protocol's primitives with ``meter``'s timers while the block runs (restored after); a client
    node in ``replay`` gets a copy of that share instead of computing its own (module docstring)."""
    saved = {name: getattr(sa, name) for name in SA_TIMED if hasattr(sa, name)}
    encode, decode = SkellamParams.encode, SkellamParams.decode
    timed_encode = meter.wrap("Skellam encode", encode)

    def encode_or_replay(self, update, rotation_seed, rng):
        if replay and meter.label[0] == "client" and meter.label[1] in replay:
            return replay[meter.label[1]].copy()  # the caller adds its masks in place
        return timed_encode(self, update, rotation_seed, rng)

    try:
        for name, fn in saved.items():
            setattr(sa, name, meter.wrap(SA_TIMED[name], fn))
        SkellamParams.encode = encode_or_replay
        SkellamParams.decode = meter.wrap("Skellam decode", decode)
        yield
    finally:
        for name, fn in saved.items():
            setattr(sa, name, fn)
        SkellamParams.encode, SkellamParams.decode = encode, decode


def config_bytes(record: ConfigRecord) -> int:
    """``ConfigRecord.count_bytes()``'s rule, also for empty lists (Flower's reads ``v[0]`` and raises on one)."""
    total = 0
    for key, value in record.items():
        items = value if isinstance(value, list) else [value]
        total += len(key) + sum(len(v) if isinstance(v, (bytes, str)) else 1 if isinstance(v, bool) else 8
                                for v in items)
    return total


def content_bytes(content: RecordDict) -> int:
    total = 0
    for record in content.values():
        if isinstance(record, (ArrayRecord, MetricRecord)):
            total += record.count_bytes()
        elif isinstance(record, ConfigRecord):
            total += config_bytes(record)
    return total


class LocalGrid:
    """The one call of Flower's ``Grid`` the protocol makes, in process: each message to its node's handler
    (``None`` back: that node sent nothing); records the handlers' seconds and each message's bytes."""

    def __init__(self, handlers: dict[int, Callable[[Message], Message | None]], meter: Meter) -> None:
        self.handlers, self.meter = handlers, meter
        self.nbytes: dict[tuple[int, str, str], int] = defaultdict(int)  # (node, stage, "down"/"up")
        self.client_seconds = 0.0  # inside handlers, since the last reset
        self.bookkeeping = 0.0  # this class's own counting

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            t0 = time.perf_counter()
            node, stage = msg.metadata.dst_node_id, msg.content.config_records[sa.SECAGG]["stage"]
            self.nbytes[node, stage, "down"] += content_bytes(msg.content)
            t1 = time.perf_counter()
            with self.meter.on("client", node, stage):
                reply = self.handlers[node](msg)
            t2 = time.perf_counter()
            self.meter.add("total", t2 - t1, ("client", node, stage))
            if reply is not None:
                assert reply.metadata.src_node_id == node
                if not reply.has_error():
                    self.nbytes[node, stage, "up"] += content_bytes(reply.content)
                replies.append(reply)
            self.client_seconds += t2 - t1
            self.bookkeeping += (t1 - t0) + (time.perf_counter() - t2)
        return replies


# -- the workload --------------------------------------------------------------------------------------------
def layout_of(d: int) -> dict[str, tuple[int, ...]]:
    """A logistic regression's {weight (out, in), bias (out,)} of d values (the tag model: 500 x 10,000 + 500)."""
    out = next((o for o in (500, 50, 10, 1) if d % o == 0 and d // o > 1), 1)
    return {"weight": (out, d // out - 1), "bias": (out,)} if out > 1 else {"weight": (d,)}


class Workload:
    def __init__(self, d: int, args: argparse.Namespace, noise_multiplier: float) -> None:
        self.d, self.args, self.n = d, args, args.clients
        self.z, self.clip = noise_multiplier, args.clip_norm
        self.layout = layout_of(d)
        gen = torch.Generator().manual_seed(d)
        self.x = torch.randn(d, generator=gen) * 0.1
        self.broadcast = layout_to_record(self.x, self.layout)
        self.nodes = [1000 + i for i in range(self.n)]
        self.deltas = {}
        for i, node in enumerate(self.nodes):
            delta = torch.randn(d, generator=gen)
            self.deltas[node] = delta.mul_(self.clip * (0.5 + 1.5 * i / max(1, self.n - 1)) / delta.norm())
        self.params = SkellamParams(dim=d, clip_norm=self.clip, noise_multiplier=self.z, expected_cohort=self.n,
                                    bits=args.bits)
        self.secagg = SecureAggregation(threshold=args.threshold, neighbours=args.neighbours, bits=args.bits)
        self.settings = ClientSettings(self.z, self.clip, self.n, args.bits, args.threshold, args.neighbours)

    def stub(self, meter: Meter) -> Callable[[Message, Context], Message]:
        """The client's "training": its full weights, the broadcast plus its delta (timed as STUB)."""
        def train(msg: Message, context: Context) -> Message:
            t0 = time.perf_counter()
            start, layout = record_to_layout(msg.content.array_records["arrays"])
            reply = Message(RecordDict({"arrays": layout_to_record(start + self.deltas[context.node_id], layout)}),
                            reply_to=msg)
            meter.add(STUB, time.perf_counter() - t0)
            return reply
        return train

    def clipped_sum(self, nodes: Iterable[int]) -> torch.Tensor:
        """The exact sum of the clients' clipped updates as they compute them (w - x in float32, clipped in float64)."""
        total = torch.zeros(self.d, dtype=torch.float64)
        for node in nodes:
            u = ((self.x + self.deltas[node]) - self.x).double()
            total += u * min(1.0, self.clip / float(u.norm()))
        return total


def secagg_round(w: Workload, rnd_no: int, meter: Meter, drop: int | None = None,
                 replay: dict[int, np.ndarray] | None = None) -> dict:
    """One SecAgg+ round through the protocol; ``drop``: that node sends no collect reply (nor anything after);
    ``replay``: these nodes send that share (masked as usual) instead of computing theirs (untimed clients)."""
    contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={}) for n in w.nodes}
    train = w.stub(meter)

    def handler(node: int) -> Callable[[Message], Message | None]:
        def answer(msg: Message) -> Message | None:
            if node == drop and msg.content.config_records[sa.SECAGG]["stage"] == "collect":
                return None
            return handle(msg, contexts[node], w.settings, train)
        return answer

    grid = LocalGrid({n: handler(n) for n in w.nodes}, meter)
    server: dict[str, float] = {}
    rotation = int.from_bytes(os.urandom(4), "little")
    with instrumented(meter, replay):
        rnd = SecAggRound(grid, w.secagg, rnd_no, rotation, list(w.nodes))
        t0 = time.perf_counter()
        with meter.on("server", "prepare"):
            receivers = rnd.prepare()
        server["forwarding (setup + share-keys)"] = time.perf_counter() - t0 - grid.client_seconds - grid.bookkeeping
        t0 = time.perf_counter()
        with meter.on("server", "collect"):
            messages = [Message(RecordDict({"arrays": w.broadcast, "config": ConfigRecord({"server-round": rnd_no}),
                                            sa.SECAGG: rnd.collect_content(node)}),
                                dst_node_id=node, message_type="train", group_id=str(rnd_no)) for node in receivers]
        server["collect messages"] = time.perf_counter() - t0
        replies = grid.send_and_receive(messages)
        agg = SecureSum(w.params, noise_multiplier=w.z, expected_cohort=float(w.n))
        agg.rotation_seed = rotation
        t0 = time.perf_counter()
        for reply in replies:
            if not reply.has_error():
                upload = masked_upload(reply.content, w.params.padded_dim, w.params.bits)
                agg.add_masked(reply.metadata.src_node_id, upload)
        rnd.check(agg.survivors)
        server["unpack + sum masked uploads"] = time.perf_counter() - t0
        before = (grid.client_seconds, grid.bookkeeping)
        unmask_wall, consistency_wall = [], []
        honest_consistency = rnd.consistency

        def consistency(survivors: list[int]) -> list[int]:
            t, clients = time.perf_counter(), grid.client_seconds + grid.bookkeeping
            with meter.on("server", "consistency"):
                out = honest_consistency(survivors)
            consistency_wall.append(time.perf_counter() - t - (grid.client_seconds + grid.bookkeeping - clients))
            return out

        rnd.consistency = consistency  # type: ignore[method-assign]

        def unmask() -> np.ndarray:
            t = time.perf_counter()
            out = rnd.unmask(agg.survivors, w.params.padded_dim)
            unmask_wall.append(time.perf_counter() - t)
            return out

        agg.unmask = unmask
        t0 = time.perf_counter()
        with meter.on("server", "unmask"):
            released = agg.release(None)
        release_wall = time.perf_counter() - t0
    unmask_clients = grid.client_seconds - before[0] + grid.bookkeeping - before[1]
    server["consistency (wall, clients' answers excluded)"] = consistency_wall[0]
    server["unmask (wall, clients' unmask answers excluded)"] = unmask_wall[0] - unmask_clients - consistency_wall[0]
    decode = meter.seconds["server", "unmask", "Skellam decode"]
    server["decode (unscale + inverse rotation)"] = decode
    server["release: subtract masks, divide by m"] = release_wall - unmask_wall[0] - decode
    return {"server": server, "grid": grid, "released": released, "survivors": list(agg.survivors)}


def plaintext_round(w: Workload, rnd_no: int, meter: Meter, drop: int | None = None) -> dict:
    """One round of the plaintext distributed placement: the client mod around the stub, the server's sum."""
    mod = client_noise_mod(placement="distributed", noise_multiplier=w.z, clip_norm=w.clip, expected_cohort=w.n)
    train = w.stub(meter)
    replies, nbytes, seconds = [], {}, {}
    for node in w.nodes:
        context = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
        msg = Message(RecordDict({"arrays": w.broadcast, "config": ConfigRecord({"server-round": rnd_no})}),
                      dst_node_id=node, message_type="train", group_id=str(rnd_no))
        with meter.on("plain", node):
            t0 = time.perf_counter()
            reply = mod(msg, context, train)
            seconds[node] = time.perf_counter() - t0 - meter.seconds["plain", node, STUB]
        meter.seconds.pop(("plain", node, STUB))
        nbytes[node] = (content_bytes(msg.content), content_bytes(reply.content))
        if node != drop:
            replies.append(reply)
    start, layout = record_to_layout(w.broadcast)
    agg = PrivateSum(w.d, clip_norm=w.clip, noise_multiplier=w.z, expected_cohort=float(w.n), placement="distributed")
    t0 = time.perf_counter()
    for reply in replies:
        agg.add_(reply_to_update(reply.content, start, layout), reply.metadata.src_node_id)
    t1 = time.perf_counter()
    agg.release(GaussianNoise(0, secure=True))
    t2 = time.perf_counter()
    return {"client": seconds, "bytes": nbytes,
            "server": {"read + sum replies": t1 - t0, "release (top-up noise if a share is missing), divide": t2 - t1}}


# -- the client's encode and masks, step by step -------------------------------------------------------------
def encode_steps(p: SkellamParams, update: torch.Tensor, seed: int, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """``SkellamParams.encode``'s steps, timed one by one (the caller asserts the same result)."""
    t, out = time.perf_counter(), {}

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[name], t = now - t, now

    x = update.detach().to(torch.float64).flatten()
    norm = float(torch.linalg.vector_norm(x))
    if norm > p.clip_norm:
        x = x * (p.clip_norm / norm)
    lap("clip (float64)")
    y = rotate(x, seed, p.padded_dim)
    lap("rotate (signs + Hadamard, padded to D)")
    y = y.mul_(p.scale).numpy()
    lap("scale")
    rounded = conditional_rounding(y, p.l2_sensitivity, rng)
    lap("conditional rounding")
    if p.share_variance > 0:
        lam = p.share_variance / 2
        rounded += rng.poisson(lam, size=rounded.size) - rng.poisson(lam, size=rounded.size)
    lap("Skellam noise (2 Poisson draws)")
    values = np.bitwise_and(rounded.astype(np.uint64), np.uint64(p.modulus - 1)).astype(np.uint32)
    lap("wrap mod 2^b to uint32")
    return values, out


def prg_steps(seed: bytes, size: int, bits: int) -> tuple[np.ndarray, dict]:
    t0 = time.perf_counter()
    key = hashlib.sha256(seed).digest()
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(4 * size))
    t1 = time.perf_counter()
    values = np.frombuffer(stream, dtype="<u4").astype(np.uint32) & np.uint32((1 << bits) - 1)
    t2 = time.perf_counter()
    return values, {"AES-256-CTR keystream": t1 - t0, "to uint32, mask to b bits": t2 - t1}


def decode_steps(p: SkellamParams, modular: np.ndarray, seed: int) -> tuple[torch.Tensor, dict]:
    t0 = time.perf_counter()
    signed = np.asarray(modular, dtype=np.int64) & (p.modulus - 1)
    signed[signed >= p.modulus // 2] -= p.modulus
    scaled = torch.from_numpy(signed.astype(np.float64) / p.scale)
    t1 = time.perf_counter()
    out = unrotate(scaled, seed, p.dim).float()
    t2 = time.perf_counter()
    return out, {"unscale (signed, / s)": t1 - t0, "inverse rotation": t2 - t1}


@contextlib.contextmanager
def kernel(out: dict, key: str):
    """The block's kernel CPU seconds and minor page faults (fresh pages mapped), under ``out[key]``."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    yield
    after = resource.getrusage(resource.RUSAGE_SELF)
    out[key] = (after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt)


def direct(w: Workload, rep: int, faults: dict) -> dict[str, float]:
    """The client's encode, one mask and the baseline's noised_upload, called directly; the server's decode."""
    node = w.nodes[-1]
    update = SparseUpdate.dense(((w.x + w.deltas[node]) - w.x))
    seed, out = 12345 + rep, {}
    t0 = time.perf_counter()
    with kernel(faults, "noised_upload"):
        noised_upload(update, w.clip, client_noise_std("distributed", w.z, w.clip, w.n), GaussianNoise(0, secure=True))
    out["noised_upload (clip + Gaussian, float32)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with kernel(faults, "SkellamParams.encode"):
        encoded = w.params.encode(update.values, seed, client_rng(7, rep))
    out["SkellamParams.encode"] = time.perf_counter() - t0
    w.share = encoded  # a real share of this size, for the clients that replay one
    again, steps = encode_steps(w.params, update.values, seed, client_rng(7, rep))
    assert np.array_equal(encoded, again), "encode's steps differ from SkellamParams.encode"
    out.update({f"encode: {k}": v for k, v in steps.items()})
    t0 = time.perf_counter()
    mask = prg_mask(os.urandom(32), w.params.padded_dim, w.params.bits)
    out["prg_mask (one mask of D values)"] = time.perf_counter() - t0
    secret = os.urandom(32)
    again, steps = prg_steps(secret, w.params.padded_dim, w.params.bits)
    assert np.array_equal(prg_mask(secret, w.params.padded_dim, w.params.bits), again), "prg steps differ"
    out.update({f"prg_mask: {k}": v for k, v in steps.items()})
    total = (encoded + mask) & np.uint32(w.params.modulus - 1)
    t0 = time.perf_counter()
    with kernel(faults, "SkellamParams.decode"):
        decoded = w.params.decode(total, seed)
    out["SkellamParams.decode"] = time.perf_counter() - t0
    again, steps = decode_steps(w.params, total, seed)
    assert torch.equal(decoded, again), "decode's steps differ from SkellamParams.decode"
    out.update({f"decode: {k}": v for k, v in steps.items()})
    return out


# -- correctness ---------------------------------------------------------------------------------------------
def check_correct(d: int, args: argparse.Namespace) -> list[str]:
    """The released sum vs the exact sum of the clipped updates at z = 0, with and without one dropout."""
    w = Workload(d, args, noise_multiplier=0.0)
    lines = []
    for drop in (None, w.nodes[0]):
        out = secagg_round(w, 1, Meter(), drop=drop)
        survivors = [n for n in w.nodes if n != drop]
        assert sorted(out["survivors"]) == survivors
        got = out["released"].double() * w.n  # release divides by m
        err = float((got - w.clipped_sum(survivors)).norm())
        bound = w.params.rounding_error_bound(len(survivors))
        assert err <= bound, f"decoded sum off by {err:.3g} > bound {bound:.3g} (dropout {drop})"
        lines.append(f"d = {d:,}, z = 0, {len(survivors)} of {w.n} clients"
                     f"{'' if drop is None else ' (one dropped after share-keys)'}: |released sum - sum of clipped "
                     f"updates|_2 = {err:.3g} <= rounding_error_bound = {bound:.3g} (norm of the sum "
                     f"{float(w.clipped_sum(survivors).norm()):.3g})")
    return lines


# -- reporting -----------------------------------------------------------------------------------------------
def mmm(xs: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}, {fmt.format(max(xs))}]"


def ratio(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x [{min(xs):.2f}, {max(xs):.2f}]"


def ms(xs: list[float]) -> str:
    return mmm([x * 1e3 for x in xs], "{:.1f}")


def mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e5 else f"{n / 1e3:.2f} kB"


def client_breakdown(meter: Meter, nodes: list[int]) -> dict[tuple[str, str], float]:
    """Mean seconds per client of each (stage, op), "total" per stage without the stub, "other" = the rest."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for (side, *rest), sec in meter.seconds.items():
        if side == "client" and rest[0] in nodes:
            node, stage, op = rest
            out[stage, op] += sec / len(nodes)
    for stage in sa.STAGES:
        stub = out.pop((stage, STUB), 0.0)
        out[stage, "total"] -= stub
        out[stage, "other"] = out[stage, "total"] - sum(v for (s, op), v in out.items()
                                                        if s == stage and op not in ("total", "other"))
    return out


def server_ops(meter: Meter) -> list[str]:
    """The timed parts of the server's unmask (its decode is reported on its own)."""
    return sorted({key[2] for key in meter.seconds if key[:2] == ("server", "unmask") and key[2] != "Skellam decode"})


def run_size(d: int, args: argparse.Namespace) -> None:
    w = Workload(d, args, noise_multiplier=args.noise_multiplier)
    p = w.params
    print(f"\n## d = {d:,} (layout {w.layout}; padded to D = {p.padded_dim:,} = 2^{p.padded_dim.bit_length() - 1} "
          f"for the rotation, {p.padded_dim / d:.3f} d), n = {w.n}, k = {args.neighbours}, t = {args.threshold}, "
          f"b = {args.bits}, C = {w.clip:g}, z = {w.z:g} (scale s = {p.scale:.6g})\n", flush=True)
    timed_n = w.n if d <= args.replay_above else min(w.n, args.timed_clients)
    if timed_n < w.n:
        print(f"(d > {args.replay_above:,}: each round, {timed_n} of the {w.n} clients, a different {timed_n} each "
              f"repetition, compute their Skellam share and are timed; the other {w.n - timed_n} send a copy of a "
              "precomputed real share through the same protocol (keys, Shamir shares, masks, messages all real), so "
              "the server's work is the full cohort's; the dropout rounds replay every share)\n")
    direct(w, 0, {})  # warm-up: the large allocations' first touch
    plaintext_round(w, 0, Meter())
    reps: list[dict] = []
    for rep in range(args.repeat):
        row: dict = {"timed": [w.nodes[(rep * timed_n + i) % w.n] for i in range(timed_n)]}
        replay = replayed_shares(w.share, [n for n in w.nodes if n not in row["timed"]])
        order = ("plain", "secagg") if rep % 2 == 0 else ("secagg", "plain")
        for path in order:
            meter = Meter()
            t0 = time.perf_counter()
            if path == "plain":
                row["plain"] = plaintext_round(w, rep + 1, meter)
            else:
                row["secagg"] = secagg_round(w, rep + 1, meter, replay=replay)
                row["meter"] = meter
            row[f"{path}_wall"] = time.perf_counter() - t0
        row["dropped"] = w.nodes[rep % w.n]
        row["drop_meter"] = Meter()
        t0 = time.perf_counter()
        row["drop"] = secagg_round(w, rep + 1, row["drop_meter"], drop=row["dropped"],
                                   replay=replayed_shares(w.share, w.nodes) if timed_n < w.n else None)
        row["drop_wall"] = time.perf_counter() - t0
        row["plain_drop"] = plaintext_round(w, rep + 1, Meter(), drop=row["dropped"])
        row["faults"] = {}
        row["direct"] = direct(w, rep + 1, row["faults"])
        row["client"] = client_breakdown(row["meter"], row["timed"])
        row["client_total"] = sum(row["client"][s, "total"] for s in sa.STAGES)
        row["plain_client"] = statistics.fmean(row["plain"]["client"].values())
        reps.append(row)
        print(f"  repetition {rep + 1} ({'/'.join(order)}): per client {row['plain_client'] * 1e3:.1f} ms plaintext, "
              f"{row['client_total'] * 1e3:.1f} ms SecAgg+; server {sum(row['plain']['server'].values()) * 1e3:.1f} ms "
              f"plaintext, {sum(row['secagg']['server'].values()) * 1e3:.1f} ms SecAgg+; rounds' wall "
              f"{row['plain_wall']:.1f} s and {row['secagg_wall']:.1f} s; with one dropout: server "
              f"{sum(row['drop']['server'].values()) * 1e3:.1f} ms SecAgg+ (round's wall {row['drop_wall']:.1f} s)",
              flush=True)

    # bytes (the same every repetition: sizes are fixed)
    grid: LocalGrid = reps[0]["secagg"]["grid"]
    per_stage = {(s, way): statistics.fmean(grid.nbytes[n, s, way] for n in w.nodes)
                 for s in sa.STAGES for way in ("down", "up")}
    sec_down = sum(per_stage[s, "down"] for s in sa.STAGES)
    sec_up = sum(per_stage[s, "up"] for s in sa.STAGES)
    plain_down = statistics.fmean(b[0] for b in reps[0]["plain"]["bytes"].values())
    plain_up = statistics.fmean(b[1] for b in reps[0]["plain"]["bytes"].values())
    four_d = 4 * d

    client_ratio = [r["client_total"] / r["plain_client"] for r in reps]
    srv_plain = [sum(r["plain"]["server"].values()) for r in reps]
    srv_sec = [sum(r["secagg"]["server"].values()) for r in reps]
    print(f"\n{args.repeat} repetitions, the two paths interleaved (order alternating); median [min, max] over "
          f"repetitions; per client: the mean over the cohort ({timed_n} timed SecAgg+ clients per repetition); "
          "ratios: SecAgg+ / plaintext in the same repetition\n")
    print("| per client per round | plaintext distributed (clip + Gaussian, float32) | SecAgg+ + Skellam | "
          "SecAgg+ / plaintext |")
    print("|---|---|---|---|")
    print(f"| client ms, all stages (training excluded) | {ms([r['plain_client'] for r in reps])} | "
          f"{ms([r['client_total'] for r in reps])} | {ratio(client_ratio)} |")
    print(f"| bytes up | {plain_up:,.0f} ({plain_up / four_d:.3f} x 4d) | {sec_up:,.0f} ({sec_up / four_d:.3f} x 4d) | "
          f"{sec_up / plain_up:.2f}x |")
    print(f"| bytes down | {plain_down:,.0f} ({plain_down / four_d:.3f} x 4d) | {sec_down:,.0f} "
          f"({sec_down / four_d:.3f} x 4d) | {sec_down / plain_down:.2f}x |")
    print(f"| messages down + up | 1 + 1 | {len(sa.STAGES)} + {len(sa.STAGES)} | |")
    print(f"| server ms per round ({w.n} clients) | {ms(srv_plain)} | {ms(srv_sec)} | "
          f"{ratio([b / a for a, b in zip(srv_plain, srv_sec)])} |")

    print("\nClient, where the time goes (ms per client per round: median [min, max]; calls per client; share of the "
          "client's SecAgg+ total, medians)\n")
    print("| stage | part | ms | calls | share |")
    print("|---|---|---|---|---|")
    total_med = statistics.median(r["client_total"] for r in reps)
    calls = defaultdict(float)
    for (side, *rest), c in reps[0]["meter"].calls.items():
        if side == "client" and rest[0] in reps[0]["timed"]:
            calls[rest[1], rest[2]] += c / timed_n
    for stage in sa.STAGES:
        ops = [op for (s, op) in reps[0]["client"] if s == stage and op not in ("total", "other")]
        for op in sorted(set(ops), key=lambda o: -statistics.median(r["client"][stage, o] for r in reps)) + ["other", "total"]:
            vals = [r["client"][stage, op] for r in reps]
            label = f"**{stage} total**" if op == "total" else op
            print(f"| {stage} | {label} | {ms(vals)} | {'' if op in ('total', 'other') else f'{calls[stage, op]:g}'} | "
                  f"{statistics.median(vals) / total_med:.1%} |")
    print(f"| all | **client total** | {ms([r['client_total'] for r in reps])} | | 100% |")

    print("\nClient's encode and masks called directly (ms per call; ratio to noised_upload in the same repetition)\n")
    print("| call | ms | / noised_upload |")
    print("|---|---|---|")
    base = [r["direct"]["noised_upload (clip + Gaussian, float32)"] for r in reps]
    for key in reps[0]["direct"]:
        vals = [r["direct"][key] for r in reps]
        print(f"| {key} | {ms(vals)} | {ratio([v / b for v, b in zip(vals, base)])} |")
    k_masks = calls["collect", "PRG masks (AES-CTR)"]  # per client: its self mask and one per neighbour
    enc_masks = [r["direct"]["SkellamParams.encode"] + k_masks * r["direct"]["prg_mask (one mask of D values)"]
                 for r in reps]
    print(f"| encode + {k_masks:g} masks (self + {k_masks - 1:g} neighbours) | {ms(enc_masks)} | "
          f"{ratio([v / b for v, b in zip(enc_masks, base)])} |")
    print("\nKernel time inside those calls (median over repetitions): " + "; ".join(
        f"{key} {statistics.median(r['faults'][key][0] for r in reps) * 1e3:.0f} ms of system CPU, "
        f"{statistics.median(r['faults'][key][1] for r in reps):,.0f} minor page faults "
        f"({statistics.median(r['faults'][key][1] for r in reps) * resource.getpagesize() / 2 ** 20:,.0f} MiB of fresh "
        "pages)" for key in reps[0]["faults"]))

    print(f"\nServer per round ({w.n} clients; ms: median [min, max])\n")
    print("| path | part | ms | calls |")
    print("|---|---|---|---|")
    for key in reps[0]["plain"]["server"]:
        print(f"| plaintext | {key} | {ms([r['plain']['server'][key] for r in reps])} | |")
    print(f"| plaintext | **total** | {ms(srv_plain)} | |")
    for key in reps[0]["secagg"]["server"]:
        print(f"| SecAgg+ | {key} | {ms([r['secagg']['server'][key] for r in reps])} | |")
        if key.startswith("unmask"):
            srv_ops = server_ops(reps[0]["meter"])
            for op in srv_ops:
                vals = [r["meter"].seconds["server", "unmask", op] for r in reps]
                print(f"| SecAgg+ | - unmask: {op} | {ms(vals)} | {reps[0]['meter'].calls['server', 'unmask', op]} |")
            cl = [sum(r["meter"].seconds["client", n, "unmask", "total"] for n in w.nodes) for r in reps]
            print(f"| SecAgg+ | (clients answering unmask, all {w.n}, not in the server's total) | {ms(cl)} | |")
    print(f"| SecAgg+ | **total** | {ms(srv_sec)} | |")

    print("\nBytes per client per round, by stage (mean over the cohort; `ConfigRecord`/`ArrayRecord` byte counts)\n")
    print("| stage | down | up |")
    print("|---|---|---|")
    for s in sa.STAGES:
        print(f"| SecAgg+ {s} | {per_stage[s, 'down']:,.0f} | {per_stage[s, 'up']:,.0f} |")
    print(f"| SecAgg+ total | {sec_down:,.0f} ({mb(sec_down)}) | {sec_up:,.0f} ({mb(sec_up)}) |")
    print(f"| plaintext (one train message) | {plain_down:,.0f} ({mb(plain_down)}) | {plain_up:,.0f} ({mb(plain_up)}) |")
    print(f"| 4d (float32 model) | {four_d:,} | {four_d:,} |")
    print(f"| SecAgg+ protocol bytes besides the model and the upload (keys, ciphertexts, share lists) | "
          f"{sec_down - plain_down:,.0f} | {sec_up - per_stage['collect', 'up']:,.0f} |")
    print(f"| SecAgg+ upload (D = {p.padded_dim:,} values of b = {p.bits} bits) minus the plaintext one (float32 of d) | | "
          f"{per_stage['collect', 'up'] - plain_up:,.0f} |")

    consistency_key = "consistency (wall, clients' answers excluded)"
    added = [r["client"]["consistency", "total"] + sum(r["client"][st, op] for st in sa.STAGES if st != "consistency"
                                                        for op in ADDED) for r in reps]
    print("\nWhat the protocol against a lying server adds (identity signatures in setup, their checks in share-keys, "
          "the consistency stage, the signature checks in unmask) against the rest of the protocol (median [min, max]; "
          "share: of the client's SecAgg+ total, of the server's)\n")
    print("| part | ms | share | bytes down | bytes up |")
    print("|---|---|---|---|---|")
    print(f"| client: consistency stage + ECDSA sign/verify in the other stages | {ms(added)} | "
          f"{statistics.median(a / r['client_total'] for a, r in zip(added, reps)):.1%} | "
          f"{per_stage['consistency', 'down']:,.0f} | "
          f"{per_stage['consistency', 'up']:,.0f} |")
    print(f"| client: the rest of SecAgg+ (the previous protocol's work) | "
          f"{ms([r['client_total'] - a for a, r in zip(added, reps)])} | | | |")
    print(f"| server: consistency round (verify {w.n} signatures) | "
          f"{ms([r['secagg']['server'][consistency_key] for r in reps])} | "
          f"{statistics.median(r['secagg']['server'][consistency_key] / t for r, t in zip(reps, srv_sec)):.1%} | | |")

    # the dropout rounds
    unmask_key = "unmask (wall, clients' unmask answers excluded)"
    print(f"\nOne dropout: in each repetition, one more round in which one node (a different one each repetition) "
          f"sent setup and share-keys, then no collect reply ({w.n - 1} survivors); ms: median [min, max]; ratio: "
          "dropout / no dropout in the same repetition\n")
    print("| server, per round | no dropout | one dropout | one dropout / none | calls (none -> one dropout) |")
    print("|---|---|---|---|---|")

    def row_of(label: str, none: list[float], one: list[float], calls: str = "") -> None:
        print(f"| {label} | {ms(none)} | {ms(one)} | {ratio([b / a for a, b in zip(none, one)])} | {calls} |")

    for key in reps[0]["drop"]["server"]:
        row_of(key, [r["secagg"]["server"][key] for r in reps], [r["drop"]["server"][key] for r in reps])
        if key == unmask_key:
            for op in server_ops(reps[0]["drop_meter"]):
                none = [r["meter"].seconds["server", "unmask", op] for r in reps]
                one = [r["drop_meter"].seconds["server", "unmask", op] for r in reps]
                calls = f"{reps[0]['meter'].calls['server', 'unmask', op]} -> {reps[0]['drop_meter'].calls['server', 'unmask', op]}"
                if any(none):
                    row_of(f"- unmask: {op}", none, one, calls)
                else:
                    print(f"| - unmask: {op} | 0 | {ms(one)} | | {calls} |")
    row_of("**total**", srv_sec, [sum(r["drop"]["server"].values()) for r in reps])
    row_of("plaintext server (read + sum; top-up Gaussian draw for the missing share)", srv_plain,
           [sum(r["plain_drop"]["server"].values()) for r in reps])
    up_unmask = statistics.fmean(r["drop"]["grid"].nbytes[n, "unmask", "up"] for r in reps for n in w.nodes
                                 if n != r["dropped"])
    print(f"| bytes up per survivor at unmask | {per_stage['unmask', 'up']:,.0f} | {up_unmask:,.0f} | | |")

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[5_000_500, 100_050])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--neighbours", type=int, default=5)
    parser.add_argument("--threshold", type=int, default=3)
    parser.add_argument("--bits", type=int, default=20)
    parser.add_argument("--clip-norm", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--replay-above", type=int, default=1_000_000,
                        help="above this d, only --timed-clients clients per round compute (and are timed on) their share")
    parser.add_argument("--timed-clients", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: one core per client, as a "
                        "device would give it; numpy's draws and AES are single-threaded either way)")
    parser.add_argument("--check-size", type=int, default=100_050, help="d of the z = 0 correctness check")
    parser.add_argument("--quick", action="store_true", help="sizes 100,050 and 10,000, 2 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeat = [100_050, 10_000], 2
    torch.set_num_threads(args.threads)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1

    import cryptography
    import flwr
    print(machine_line(f"numpy {np.__version__}, cryptography {cryptography.__version__}, flwr {flwr.__version__}, "))
    print(" ".join([os.path.basename(sys.executable), *sys.argv]))
    t0 = time.perf_counter()
    for line in check_correct(args.check_size, args):
        print("correct: " + line)
    print(f"(correctness check {time.perf_counter() - t0:.1f} s)", flush=True)
    for d in args.sizes:
        run_size(d, args)
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(f"\nfinished {datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC ({time.perf_counter() - t0:.0f} s), "
          f"load average {os.getloadavg()[0]:.2f}; peak RSS {hwm / 1024:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
