"""SecAgg+ with distributed Skellam noise against a DPFedAvg in a stock Flower ServerApp (issue "Secure aggregation",
items 1, 2 and 4): what the server holds, exactness of the unmasked sum, z = 0 against the plaintext round, the
noise std, dropouts accounted with the survivors' noise, and clean failure below the threshold."""

import argparse
import logging
import re
import os

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from scipy import stats

from fedprivacy.engines.inprocess import InProcessGrid
from fedprivacy.fl.bit_packing import pack_bits, packed_size, unpack_bits
from fedprivacy.fl import secure_aggregation as secagg
from fedprivacy.fl.secure_aggregation import SECAGG, SecureAggregation, secure_aggregation_mod
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.privacy.skellam import SkellamParams, signed
from fedprivacy.privacy.skellam_accounting import SkellamRound

from test_strategy import _flat, _model, _plain_client_app  # this folder is on sys.path (pytest's rootdir mode)

N, C, BITS = 6, 1.0, 20
SETTINGS = SecureAggregation(threshold=3, neighbours=5, bits=BITS)


class RecordingGrid(InProcessGrid):
    """The in-process grid, keeping every message the server sent and every reply it received."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[Message] = []
        self.received: list[Message] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent.extend(messages)
        for reply in super().send_and_receive(messages, timeout=timeout):
            self.received.append(reply)
            yield reply


def _strategy(z=0.0, **kwargs) -> DPFedAvg:
    return DPFedAvg(noise_multiplier=z, clip_norm=C, expected_cohort=N, population=N, placement="distributed",
                    secure_aggregation=kwargs.pop("settings", SETTINGS), **kwargs)


def _mod(z=0.0, settings=SETTINGS, **kwargs):
    return secure_aggregation_mod(noise_multiplier=z, clip_norm=C, expected_cohort=N, bits=BITS,
                                  threshold=settings.threshold, neighbours=settings.neighbours, **kwargs)


def _client(fail=None, settings=SETTINGS) -> ClientApp:
    """A stock ClientApp (local SGD, full weights) with the SecAgg+ mod; ``fail(partition, stage)``: raise there."""
    def failing(msg: Message, context: Context, call_next):
        stage = msg.content.config_records[SECAGG]["stage"]
        if fail is not None and fail(int(context.node_config["partition-id"]), stage):
            raise RuntimeError(f"node dropped at {stage}")
        return call_next(msg, context)

    return _plain_client_app(mods=[failing, _mod(settings=settings)])


def _noisy_client(z: float, lr_zero=True) -> ClientApp:
    return _plain_client_app(mods=[_mod(z)])


def _run(strategy, client_app, rounds=1, lr=0.5, nodes=N):
    grid = RecordingGrid(client_app, nodes)
    app = ServerApp()
    out = {}

    @app.main()
    def main(g: Grid, context: Context) -> None:
        out["result"] = strategy.start(grid=g, initial_arrays=ArrayRecord(_model().state_dict()), num_rounds=rounds,
                                       train_config=ConfigRecord({"lr": lr}))

    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, 1
    with grid:
        app(grid, Context(run_id=grid.run.run_id, node_id=1, node_config={}, state=RecordDict(), run_config={}))
    return out["result"], grid


def _stage(grid: RecordingGrid, stage: str) -> list[Message]:
    ids = {m.metadata.message_id for m in grid.sent
           if SECAGG in m.content.config_records and m.content.config_records[SECAGG]["stage"] == stage}
    return [r for r in grid.received if r.metadata.reply_to_message_id in ids]


def test_the_server_holds_only_uniform_masked_uploads_whose_unmasked_sum_is_the_shares_sum_exactly(monkeypatch):
    shares, masks = [], []
    encode, unmask = SkellamParams.encode, secagg.SecAggRound.unmask

    def recording_encode(self, *args):
        share = encode(self, *args)
        shares.append(share.copy())  # the client masks its share in place
        return share

    monkeypatch.setattr(SkellamParams, "encode", recording_encode)
    monkeypatch.setattr(secagg.SecAggRound, "unmask", lambda self, *a: masks.append(unmask(self, *a)) or masks[-1])
    _, grid = _run(_strategy(z=1.0), _noisy_client(1.0))
    packed = [r.content.array_records[SECAGG]["masked"].numpy() for r in _stage(grid, "collect")]
    dim = SkellamParams(dim=_flat(ArrayRecord(_model().state_dict())).numel(), clip_norm=C, noise_multiplier=1.0,
                        expected_cohort=N, bits=BITS).padded_dim
    assert all(p.dtype == np.uint8 and p.size == packed_size(dim, BITS) for p in packed)  # b bits per coordinate
    uploads = [unpack_bits(p, dim, BITS) for p in packed]
    assert len(uploads) == len(shares) == N and len(masks) == 1
    assert all(set(r.content.keys()) == {SECAGG} for r in _stage(grid, "collect"))  # nothing else leaves a client
    modulus = np.uint64(2 ** BITS - 1)
    total = np.sum([u.astype(np.uint64) for u in uploads], axis=0)
    assert np.array_equal((total - masks[0].astype(np.uint64)) & modulus,
                          np.sum([s.astype(np.uint64) for s in shares], axis=0) & modulus)
    bins = np.arange(0, 2 ** BITS + 1, 2 ** (BITS - 6))
    for upload, share in zip(uploads, shares):
        assert stats.chisquare(np.histogram(upload, bins)[0]).pvalue > 1e-6  # uniform on [0, 2^b)
        assert stats.chisquare(np.histogram(share, bins)[0]).pvalue < 1e-6  # what it hides is far from uniform
        assert abs(np.corrcoef(upload.astype(float), share.astype(float))[0, 1]) < 0.05


def test_at_z0_the_round_equals_the_plaintext_distributed_round_within_the_rounding_bound():
    plain, _ = _run(DPFedAvg(noise_multiplier=0.0, clip_norm=C, expected_cohort=N, population=N,
                             placement="distributed"),
                    _plain_client_app(mods=[__import__("fedprivacy.fl.mods", fromlist=["x"]).client_noise_mod(
                        placement="distributed", noise_multiplier=0.0, clip_norm=C, expected_cohort=N)]))
    secure, _ = _run(_strategy(), _client())
    start = _flat(ArrayRecord(_model().state_dict()))
    moved = float((_flat(plain.arrays) - start).norm())
    params = SkellamParams(dim=start.numel(), clip_norm=C, noise_multiplier=0.0, expected_cohort=N, bits=BITS)
    gap = float((_flat(secure.arrays) - _flat(plain.arrays)).norm())
    assert moved > 0.1  # the clients trained and were clipped
    assert gap <= params.rounding_error_bound(N) / N + 1e-5  # server lr 1: x_1 = x_0 + sum / m
    assert gap > 0  # it did go through the integers


def test_the_released_noise_std_matches_the_accounted_skellam_variance():
    strategy = _strategy(z=2.0)
    result, _ = _run(strategy, _noisy_client(2.0), lr=0.0)  # clients send back x_0: the release is noise alone
    change = _flat(result.arrays) - _flat(ArrayRecord(_model().state_dict()))
    params = strategy.mechanism.params()
    (event, count), = strategy.mechanism.ledger.entries
    assert isinstance(event, SkellamRound) and count == 1
    assert event.variance == pytest.approx(params.total_variance)  # all N shares arrived
    assert float(change.std()) * N == pytest.approx(np.sqrt(event.variance) / params.scale, rel=0.03)
    assert float(change.std()) * N == pytest.approx(2.0 * C, rel=0.03)  # (z C)^2 on the sum, as planned


@pytest.mark.parametrize("stage", secagg.STAGES)
def test_a_client_dropping_at_any_stage_leaves_a_round_accounted_with_the_survivors_noise(stage, caplog):
    strategy = _strategy(z=1.0)
    result, grid = _run(strategy, _client(lambda partition, at: partition == 2 and at == stage), rounds=2)
    events = [e for e, n in strategy.mechanism.ledger.entries for _ in range(n)]
    params = strategy.mechanism.params()
    uploaded = secagg.STAGES.index(stage) > secagg.STAGES.index("collect")
    shares = N if uploaded else N - 1  # a node that uploaded its masked share added its noise
    assert len(events) == 2 and all(e.variance == pytest.approx(shares * params.share_variance) for e in events)
    metrics = result.train_metrics_clientapp[2]
    assert metrics["secagg_survivors"] == shares and metrics["cohort_dropped"] == N - shares
    assert metrics[f"secagg_failed_{stage.replace('-', '_')}"] == 1  # and logged, naming the node and its reason
    assert sum(v for k, v in metrics.items() if k.startswith("secagg_failed_")) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "failed at" in r.getMessage()]
    assert any(f"failed at {stage}: node " in w and "node dropped at" in w for w in warnings)
    assert not any(r.levelname == "ERROR" for r in caplog.records)


def test_below_the_threshold_the_round_fails_cleanly_and_the_run_goes_on(caplog):
    strategy = _strategy(z=1.0, settings=SecureAggregation(threshold=5, neighbours=5, bits=BITS))
    start = _flat(ArrayRecord(_model().state_dict()))
    fail = {1: {0, 1}, 2: set()}  # round 1: two of six nodes fail at collect (4 survivors < 5); round 2: none
    calls = {"round": 0}

    def dropping(partition, stage):
        if stage == "setup" and partition == 0:
            calls["round"] += 1
        return stage == "collect" and partition in fail[calls["round"]]

    with caplog.at_level(logging.ERROR):
        result, _ = _run(strategy, _client(dropping, settings=strategy.secure_aggregation), rounds=2)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "aborted" in errors[0] and "nothing accounted" in errors[0]
    assert result.train_metrics_clientapp[1]["secagg_aborted"] == 1.0
    aborted = result.train_metrics_clientapp[1]  # the true numbers: 6 sampled, 4 uploaded, 2 dropped at collect
    assert (aborted["cohort_sampled"], aborted["secagg_survivors"], aborted["cohort_dropped"]) == (6, 4, 2)
    assert aborted["secagg_failed_collect"] == 2 and aborted["secagg_failed_setup"] == 0
    assert result.train_metrics_clientapp[2]["secagg_aborted"] == 0.0
    assert strategy.mechanism.ledger.rounds == 1  # round 1 released and accounted nothing
    assert not torch.equal(_flat(result.arrays), start)


def test_an_abort_before_the_model_is_sent_releases_and_accounts_nothing(caplog):
    strategy = _strategy(z=1.0, settings=SecureAggregation(threshold=5, neighbours=5, bits=BITS))
    with caplog.at_level(logging.ERROR):
        result, grid = _run(strategy, _client(lambda partition, at: partition < 2 and at == "setup",
                                              settings=strategy.secure_aggregation))
    assert strategy.mechanism.ledger.rounds == 0
    assert not any("arrays" in m.content for m in grid.sent)  # the model never left the server
    assert torch.equal(_flat(result.arrays), _flat(ArrayRecord(_model().state_dict())))


def test_secure_aggregation_refuses_the_settings_it_cannot_account():
    with pytest.raises(ValueError, match="placement='distributed'"):
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=10, secure_aggregation=SETTINGS)
    with pytest.raises(ValueError, match="sampling='poisson'"):
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=10, placement="distributed",
                 sampling="fixed", secure_aggregation=SETTINGS)
    with pytest.raises(ValueError, match="record_level"):
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=10, placement="distributed",
                 record_level=True, secure_aggregation=SETTINGS)
    for threshold, neighbours in ((1, 5), (6, 5), (3, 4), (2, 5), (3, 6)):
        with pytest.raises(ValueError, match="threshold|neighbours"):
            SecureAggregation(threshold=threshold, neighbours=neighbours)
        with pytest.raises(ValueError, match="threshold|neighbours"):
            _mod(settings=argparse.Namespace(threshold=threshold, neighbours=neighbours))
    with pytest.raises(ValueError, match="2 \\* threshold > neighbours"):
        SecureAggregation(threshold=3, neighbours=7)
    with pytest.raises(ValueError, match="identity_key"):
        _mod(identity_key=b"not a key")
    with pytest.raises(ValueError, match="roster"):
        _mod(roster=[b"not a key"])


def test_a_crash_after_a_logged_release_with_a_dropout_resumes_with_that_release_accounted(tmp_path):
    """The release log holds a Skellam round of 5 survivors the checkpoint does not: the resume accepts it (a round
    of this mechanism with fewer shares) and accounts it; a log of another mechanism's round is refused."""
    rounds_seen = [0]

    def counting(partition, stage):  # node 2 drops at collect in the second round this client app sees
        if stage == "setup" and partition == 0:
            rounds_seen[0] += 1
        return partition == 2 and stage == "collect" and rounds_seen[0] == 2

    _run(_strategy(z=1.0, state_dir=tmp_path), _client(counting), rounds=1)
    after_round_1 = (tmp_path / "checkpoint.pt").read_bytes()
    _run(_strategy(z=1.0, state_dir=tmp_path), _client(counting), rounds=2)
    (tmp_path / "checkpoint.pt").write_bytes(after_round_1)  # a crash after release 2 was logged, before its checkpoint
    resumed = _strategy(z=1.0, state_dir=tmp_path)
    _run(resumed, _client(), rounds=3)
    shares = [round(e.variance / resumed.mechanism.params().share_variance)
              for e, n in resumed.mechanism.ledger.entries for _ in range(n)]
    assert shares == [N, N - 1, N, N]  # release 2 (5 survivors) accounted; round 2 ran again as release 3
    with pytest.raises(Exception, match="secure_aggregation"):  # another mechanism on this state is refused
        DPFedAvg(noise_multiplier=1.0, clip_norm=C, expected_cohort=N, population=N, placement="distributed",
                 state_dir=tmp_path)


# --- a malicious client's modular wrap ------------------------------------------------------------------

def _tampering_client(z: float, tamper) -> ClientApp:
    """Honest clients, except that node partition 0 adds ``tamper(values)`` (uint32, length D) to its masked upload
    after the SecAgg+ mod packed it: what a malicious client can send."""
    def mod(msg: Message, context: Context, call_next):
        reply = call_next(msg, context)
        if (secagg.is_secagg(msg) and msg.content.config_records[SECAGG]["stage"] == "collect"
                and int(context.node_config["partition-id"]) == 0):
            packed = reply.content.array_records[SECAGG]["masked"].numpy()
            size = len(packed) * 8 // BITS
            values = unpack_bits(packed, size, BITS) + tamper(size)
            reply.content = RecordDict({SECAGG: ArrayRecord({"masked": Array(pack_bits(values & (2 ** BITS - 1), BITS))})})
        return reply

    return _plain_client_app(mods=[mod, _mod(z)])


def _wrap(coordinates):
    """``2^(b-1) - 1`` added to the given coordinates of the upload: each decodes about 2^(b-1) away."""
    def tamper(size: int) -> np.ndarray:
        added = np.zeros(size, dtype=np.uint32)
        added[coordinates] = 2 ** (BITS - 1) - 1
        return added

    return tamper


def _recording_release(monkeypatch) -> list[np.ndarray]:
    """The unmasked modular sums the server decodes and the sums of the shares the clients encoded, in turn."""
    seen: list[np.ndarray] = []
    encode, check = SkellamParams.encode, SkellamParams.check_integrity
    shares: list[np.ndarray] = []

    def recording_encode(self, *args):
        shares.append(encode(self, *args).copy())
        return shares[-1].copy()

    def recording_check(self, modular_sum, n):
        seen.extend([modular_sum.copy(), np.sum([s.astype(np.uint64) for s in shares], axis=0) & np.uint64(self.modulus - 1)])
        return check(self, modular_sum, n)

    monkeypatch.setattr(SkellamParams, "encode", recording_encode)
    monkeypatch.setattr(SkellamParams, "check_integrity", recording_check)
    return seen


def test_a_single_coordinate_wrap_by_a_malicious_client_passes_the_check_within_its_measured_slack(monkeypatch, caplog):
    """The attack: one coordinate of one client's masked upload + 2^(b-1) - 1. It moves the decoded sum by about
    4 z C (2^(b-1) / s; measured 4.002 C), far inside what the L2 check must let through (``undetected_norm``:
    90.6 C here, D = 2^15, bound 188 C): the round is released, as DEPLOYMENT.md says. Per-client range proofs
    would be needed to catch it."""
    strategy = _strategy(z=1.0)
    seen = _recording_release(monkeypatch)
    with caplog.at_level(logging.ERROR):
        result, _ = _run(strategy, _tampering_client(1.0, _wrap([0])))
    tampered, honest = seen
    params = strategy.mechanism.params()
    change = (signed(tampered, BITS) - signed(honest, BITS)).astype(np.float64)
    moved = float(np.linalg.norm(change)) / params.scale  # in model units (the rotation back is orthogonal)
    assert int(np.count_nonzero(change)) == 1 and 3.9 * C < moved < 4.1 * C
    assert moved < params.undetected_norm(N) / 10
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg_aborted"] == 0.0 and metrics["secagg_integrity_refused"] == 0.0  # released
    assert strategy.mechanism.ledger.rounds == 1
    assert not any(r.levelname == "ERROR" for r in caplog.records)


@pytest.mark.parametrize("spread", ["every", "beyond_the_slack"])
def test_a_wrap_beyond_the_slack_is_refused_logged_counted_and_stays_accounted(spread, caplog, tmp_path):
    """The wrap on every coordinate, or on just enough of them to exceed twice the slack: the round is refused,
    one ERROR line names the round, the norm and the bound, the metrics count it, the model does not move, and
    the release logged ahead stays in the ledger and in the release log."""
    strategy = _strategy(z=1.0, state_dir=tmp_path)
    dim = _flat(ArrayRecord(_model().state_dict())).numel()
    params = SkellamParams(dim=dim, clip_norm=C, noise_multiplier=1.0, expected_cohort=N, bits=BITS)
    count = params.padded_dim if spread == "every" else int(np.ceil(
        (2 * params.undetected_norm(N) * params.scale / 2 ** (BITS - 1)) ** 2))
    assert count < params.padded_dim or spread == "every"
    with caplog.at_level(logging.ERROR):
        result, _ = _run(strategy, _tampering_client(1.0, _wrap(slice(0, count))))
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "round 1 refused" in errors[0], errors
    assert re.search(r"has norm [\d.e+]+, above the bound [\d.e+]+", errors[0])
    metrics = result.train_metrics_clientapp[1]
    assert metrics["secagg_integrity_refused"] == 1.0 and metrics["secagg_survivors"] == N
    assert torch.equal(_flat(result.arrays), _flat(ArrayRecord(_model().state_dict())))  # nothing released
    (event, times), = strategy.mechanism.ledger.entries
    assert times == 1 and event.variance == pytest.approx(N * params.share_variance)
    assert [e["event"] for e in ReleaseLog(tmp_path).entries] == [event]  # durable too


# -- a server that departs from the protocol in the messages it sends (10 clients, t = 4 of k = 5) ---------------
M, HONEST = 10, SecureAggregation(threshold=4, neighbours=5, bits=BITS)


def _malicious(monkeypatch, server_round, client_app=None):
    """One round of the strategy with ``server_round`` (a ``SecAggRound`` whose messages lie) against the real
    SecAgg+ mod on ``M`` honest clients configured with ``HONEST``."""
    monkeypatch.setattr("fedprivacy.fl.aggregation.SecAggRound", server_round)  # the secure part runs it
    strategy = DPFedAvg(noise_multiplier=0.0, clip_norm=C, expected_cohort=M, population=M, placement="distributed",
                        secure_aggregation=HONEST)
    mod = secure_aggregation_mod(noise_multiplier=0.0, clip_norm=C, expected_cohort=M, bits=BITS,
                                 threshold=HONEST.threshold, neighbours=HONEST.neighbours)
    result, grid = _run(strategy, client_app or _plain_client_app(mods=[mod]), nodes=M)
    return strategy, result, grid


def _replies(grid: RecordingGrid, stage: str) -> tuple[dict[int, str], dict[int, ConfigRecord]]:
    """The nodes' error reasons and their records, at ``stage``."""
    errors, ok = {}, {}
    for reply in _stage(grid, stage):
        if reply.has_error():
            errors[reply.metadata.src_node_id] = reply.error.reason
        else:
            ok[reply.metadata.src_node_id] = reply.content.config_records[SECAGG]
    return errors, ok


def _revealed(grid: RecordingGrid, node: int) -> tuple[int, int]:
    """How many shares of ``node``'s self-mask seed and of its mask key the server received."""
    _, ok = _replies(grid, "unmask")
    return (sum(list(r.get("seed-owners", [])).count(node) for r in ok.values()),
            sum(list(r.get("key-owners", [])).count(node) for r in ok.values()))


class _TwoFaced(secagg.SecAggRound):
    """Tells two of the target X's neighbours (X = the smallest node that shared its keys) that X dropped."""

    def liars(self):
        x = min(self.shared)
        return x, sorted(set(self.neighbours[x]) - {x})[:2]


@pytest.mark.slow
@pytest.mark.parametrize("lie", ["announced", "sent"])
def test_clients_refuse_a_neighbourhood_larger_than_their_own_k(monkeypatch, lie):
    monkeypatch.setattr(secagg, "_ring", lambda nodes, k, rng: {n: sorted(nodes) for n in nodes})  # whole cohort

    class WholeCohort(secagg.SecAggRound):
        def setup_content(self, node):  # "sent": announces the honest k, then sends every node's keys
            return ConfigRecord({"threshold": 4, "neighbours": M if lie == "announced" else 5})

    strategy, _, grid = _malicious(monkeypatch, WholeCohort)
    errors, _ = _replies(grid, "setup" if lie == "announced" else "share-keys")
    assert len(errors) == M and all("neighbours=5" in reason for reason in errors.values())
    assert strategy.mechanism.ledger.rounds == 0 and not any("arrays" in m.content for m in grid.sent)


@pytest.mark.slow
def test_clients_refuse_a_threshold_other_than_their_own(monkeypatch):
    class LowThreshold(secagg.SecAggRound):
        def setup_content(self, node):
            return ConfigRecord({"threshold": 2, "neighbours": 5})

    strategy, _, grid = _malicious(monkeypatch, LowThreshold)
    errors, _ = _replies(grid, "setup")
    assert len(errors) == M and all("threshold=2" in reason for reason in errors.values())
    assert strategy.mechanism.ledger.rounds == 0


@pytest.mark.slow
@pytest.mark.parametrize("lie", ["unmask lists", "survivor sets"])
def test_two_faced_dropout_lists_are_refused_and_never_unmask_both_secrets_of_a_node(monkeypatch, caplog, lie):
    """To two of X's neighbours the server says X dropped: in the unmask lists only (they contradict the survivor
    set the neighbours signed), or in the survivor set itself (then fewer than t neighbours signed that set)."""
    seen = {}

    class Liar(_TwoFaced):
        def consistency_content(self, node, survivors):
            x, liars = seen["x"], seen["liars"] = self.liars()
            return super().consistency_content(node, [n for n in survivors if n != x or
                                                      node not in liars or lie != "survivor sets"])

        def unmask_content(self, node, survivors, signers):
            x, liars = self.liars()
            if node in liars:
                survivors = [n for n in survivors if n != x]
            return super().unmask_content(node, survivors, signers)

    strategy, result, grid = _malicious(monkeypatch, Liar)
    errors, _ = _replies(grid, "unmask")
    reason = "not the signed survivor set" if lie == "unmask lists" else "signed the survivor set this node signed"
    assert set(seen["liars"]) <= set(errors) and all(reason in r for r in errors.values())
    if lie == "unmask lists":
        assert set(errors) == set(seen["liars"])
    # (with the survivor sets, a neighbour of both liars, X itself among them, sees only t - 1 signatures too)
    seeds, keys = _revealed(grid, seen["x"])
    assert keys == 0 and seeds < HONEST.threshold  # neither secret of X is rebuilt
    assert result.train_metrics_clientapp[1]["secagg_aborted"] == 1.0
    assert result.train_metrics_clientapp[1]["secagg_failed_unmask"] == len(errors)
    assert any("failed at unmask" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("forgery", ["forged", "missing", "swapped"])
def test_unmask_without_threshold_valid_consistency_signatures_is_refused(monkeypatch, forgery):
    class Forger(secagg.SecAggRound):
        def unmask_content(self, node, survivors, signers):
            record = super().unmask_content(node, survivors, signers)
            if node == min(self.shared):
                signatures = list(record["signatures"])
                record["signatures"] = {"forged": [os.urandom(len(s)) for s in signatures],
                                        "swapped": signatures[1::-1] + signatures[2:]}.get(forgery, [])
                if forgery == "missing":
                    del record["signatures"], record["signers"]
            return record

    strategy, _, grid = _malicious(monkeypatch, Forger)
    errors, ok = _replies(grid, "unmask")
    victim = min(int(r.metadata.src_node_id) for r in _stage(grid, "unmask"))
    assert set(errors) == {victim} and "signed the survivor set" in errors[victim] and victim not in ok


@pytest.mark.slow
def test_a_client_told_that_it_dropped_refuses_to_sign_or_reveal_its_own_key(monkeypatch):
    class Erase(secagg.SecAggRound):
        def consistency_content(self, node, survivors):  # every survivor is told X = min(survivors) dropped
            return super().consistency_content(node, survivors[1:])

    _, _, grid = _malicious(monkeypatch, Erase)
    errors, _ = _replies(grid, "consistency")
    x = min(r.metadata.src_node_id for r in _stage(grid, "consistency"))
    assert set(errors) == {x} and "leaves out this node itself" in errors[x]
    _, ok = _replies(grid, "unmask")
    assert x not in ok and all(x not in r.get("seed-owners", []) for r in ok.values())  # its b stays hidden


@pytest.mark.slow
@pytest.mark.parametrize("outsider", [False, True])
def test_a_neighbour_whose_identity_key_is_not_in_the_roster_is_refused(monkeypatch, outsider):
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, private_key_to_bytes, public_key_to_bytes

    keys = [generate_key_pairs() for _ in range(M)]
    roster = [public_key_to_bytes(pk) for _, pk in keys[:-1]] + [
        public_key_to_bytes(generate_key_pairs()[1] if outsider else keys[-1][1])]  # partition M-1 is not listed
    settings = {p: secagg.ClientSettings(0.0, C, M, BITS, HONEST.threshold, HONEST.neighbours, roster=frozenset(roster),
                                         identity_key=private_key_to_bytes(sk)) for p, (sk, _) in enumerate(keys)}

    def rostered(msg, context, call_next):
        return secagg.handle(msg, context, settings[int(context.node_config["partition-id"])], call_next)

    strategy, _, grid = _malicious(monkeypatch, secagg.SecAggRound, _plain_client_app(mods=[rostered]))
    errors, _ = _replies(grid, "share-keys")
    if not outsider:
        assert not errors and strategy.mechanism.ledger.rounds == 1
        return
    assert len(errors) == HONEST.neighbours and all("not in this node's roster" in r for r in errors.values())
    assert strategy.mechanism.ledger.rounds == 0


@pytest.mark.slow
def test_a_public_key_not_signed_by_its_nodes_identity_key_is_refused(monkeypatch):
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

    class Substitute(secagg.SecAggRound):
        def keys_content(self, node, alive):  # the server's own mask key in place of X's, X's signature kept
            record = super().keys_content(node, alive)
            x = str(min(alive))
            if x in record and node != min(alive):
                record[x] = [public_key_to_bytes(generate_key_pairs()[1]), *list(record[x])[1:]]
            return record

    strategy, _, grid = _malicious(monkeypatch, Substitute)
    errors, _ = _replies(grid, "share-keys")
    assert errors and all("not signed by its identity key" in r for r in errors.values())
    assert strategy.mechanism.ledger.rounds == 0
