"""SecAgg+ with distributed Skellam noise against a DPFedAvg in a stock Flower ServerApp (issue "Secure aggregation",
items 1, 2 and 4): what the server holds, exactness of the unmasked sum, z = 0 against the plaintext round, the
noise std, dropouts accounted with the survivors' noise, and clean failure below the threshold."""

import logging
import re

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


def _client(fail=None) -> ClientApp:
    """A stock ClientApp (local SGD, full weights) with the SecAgg+ mod; ``fail(partition, stage)``: raise there."""
    def failing(msg: Message, context: Context, call_next):
        stage = msg.content.config_records[SECAGG]["stage"]
        if fail is not None and fail(int(context.node_config["partition-id"]), stage):
            raise RuntimeError(f"node dropped at {stage}")
        return call_next(msg, context)

    return _plain_client_app(mods=[failing, secure_aggregation_mod(noise_multiplier=0.0, clip_norm=C, expected_cohort=N,
                                                                    bits=BITS)])


def _noisy_client(z: float, lr_zero=True) -> ClientApp:
    return _plain_client_app(mods=[secure_aggregation_mod(noise_multiplier=z, clip_norm=C, expected_cohort=N,
                                                          bits=BITS)])


def _run(strategy, client_app, rounds=1, lr=0.5):
    grid = RecordingGrid(client_app, N)
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


@pytest.mark.parametrize("stage", ["setup", "share-keys", "collect", "unmask"])
def test_a_client_dropping_at_any_stage_leaves_a_round_accounted_with_the_survivors_noise(stage, caplog):
    strategy = _strategy(z=1.0)
    result, grid = _run(strategy, _client(lambda partition, at: partition == 2 and at == stage), rounds=2)
    events = [e for e, n in strategy.mechanism.ledger.entries for _ in range(n)]
    params = strategy.mechanism.params()
    shares = N if stage == "unmask" else N - 1  # a node that uploaded its masked share added its noise
    assert len(events) == 2 and all(e.variance == pytest.approx(shares * params.share_variance) for e in events)
    assert result.train_metrics_clientapp[2]["secagg_survivors"] == shares
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
        result, _ = _run(strategy, _client(dropping), rounds=2)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "aborted" in errors[0] and "nothing accounted" in errors[0]
    assert result.train_metrics_clientapp[1]["secagg_aborted"] == 1.0
    assert result.train_metrics_clientapp[2]["secagg_aborted"] == 0.0
    assert strategy.mechanism.ledger.rounds == 1  # round 1 released and accounted nothing
    assert not torch.equal(_flat(result.arrays), start)


def test_an_abort_before_the_model_is_sent_releases_and_accounts_nothing(caplog):
    strategy = _strategy(z=1.0, settings=SecureAggregation(threshold=5, neighbours=5, bits=BITS))
    with caplog.at_level(logging.ERROR):
        result, grid = _run(strategy, _client(lambda partition, at: partition < 2 and at == "setup"))
    assert strategy.mechanism.ledger.rounds == 0
    assert not any("arrays" in m.content for m in grid.sent)  # the model never left the server
    assert torch.equal(_flat(result.arrays), _flat(ArrayRecord(_model().state_dict())))


def test_a_client_refuses_unmask_requests_that_would_reveal_both_secrets_of_a_node_or_too_few_survivors():
    state = {"owners": [2, 3, 4, 5], "threshold": 3, "seed-shares": [b"b2", b"b3", b"b4", b"b5"],
             "key-shares": [b"c2", b"c3", b"c4", b"c5"]}
    assert secagg._unmask(state, {"active": [2, 3, 4], "dropped": [5]}) == {
        "owners": [2, 3, 4, 5], "shares": [b"b2", b"b3", b"b4", b"c5"]}
    for lists in ({"active": [2, 3, 4], "dropped": [4]},  # node 4 both alive and dropped: its vector would leak
                  {"active": [2, 3], "dropped": [4, 5]},  # fewer than threshold survivors
                  {"active": [2, 3, 9], "dropped": []}):  # not a neighbour
        with pytest.raises(ValueError):
            secagg._unmask(state, lists)


def test_secure_aggregation_refuses_the_settings_it_cannot_account():
    with pytest.raises(ValueError, match="placement='distributed'"):
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=10, secure_aggregation=SETTINGS)
    with pytest.raises(ValueError, match="sampling='poisson'"):
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=10, placement="distributed",
                 sampling="fixed", secure_aggregation=SETTINGS)
    with pytest.raises(ValueError, match="record_level"):
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=10, placement="distributed",
                 record_level=True, secure_aggregation=SETTINGS)
    for threshold, neighbours in ((1, 5), (6, 5), (3, 4)):
        with pytest.raises(ValueError, match="threshold|neighbours"):
            SecureAggregation(threshold=threshold, neighbours=neighbours)


def test_a_crash_after_a_logged_release_with_a_dropout_resumes_with_that_release_accounted(tmp_path):
    """The release log holds a Skellam round of 5 survivors the checkpoint does not: the resume accepts it (a round
    of this mechanism with fewer shares) and accounts it; a log of another mechanism's round is refused."""
    rounds_seen = [0]

    def counting(partition, stage):  # node 2 drops at collect in the second round this client app sees
        if stage == "setup" and partition == 0:
            rounds_seen[0] += 1
        return partition == 2 and stage == "collect" and rounds_seen[0] == 2

    _run(_strategy(z=1.0, state_dir=tmp_path), _client(counting), rounds=1)
    after_round_1 = (tmp_path / "strategy.pt").read_bytes()
    _run(_strategy(z=1.0, state_dir=tmp_path), _client(counting), rounds=2)
    (tmp_path / "strategy.pt").write_bytes(after_round_1)  # a crash after release 2 was logged, before its checkpoint
    resumed = _strategy(z=1.0, state_dir=tmp_path)
    _run(resumed, _client(), rounds=3)
    shares = [round(e.variance / resumed.mechanism.params().share_variance)
              for e, n in resumed.mechanism.ledger.entries for _ in range(n)]
    assert shares == [N, N - 1, N, N]  # release 2 (5 survivors) accounted; round 2 ran again as release 3
    with pytest.raises(Exception, match="secure_aggregation"):  # another mechanism on this state is refused
        DPFedAvg(noise_multiplier=1.0, clip_norm=C, expected_cohort=N, population=N, placement="distributed",
                 state_dir=tmp_path)


# --- a malicious client's modular wrap (issue "Hardening III") ------------------------------------------------

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

    return _plain_client_app(mods=[mod, secure_aggregation_mod(noise_multiplier=z, clip_norm=C, expected_cohort=N,
                                                               bits=BITS)])


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
    assert metrics["secagg_aborted"] == 0.0 and "secagg_integrity_refused" not in metrics  # released
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
