"""The release log under damage (Hardening II, finding 4): a damaged log is refused, never read as fewer
releases; a line cut by a crash is cut off before the next record is appended; the epoch never goes back."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger
from fedprivacy.privacy.mechanism import GaussianMechanism
from fedprivacy.privacy.release_log import RELEASES, ReleaseLog
from fedprivacy.run import run


def _log_lines(folder) -> list[str]:
    return (folder / RELEASES).read_text().splitlines()


def _damage(folder, how: str) -> None:
    path = folder / RELEASES
    lines = path.read_text().splitlines(keepends=True)
    if how == "deleted":
        path.unlink()
    elif how == "emptied":
        path.write_text("")
    elif how == "cut below the ledger":
        path.write_text("".join(lines[:2]))
    elif how == "head cut":
        path.write_text("".join(lines[1:]))
    elif how == "event edited":  # a release claimed at more noise than it had: a lower epsilon
        entry = json.loads(lines[1])
        entry["event"]["noise_multiplier"] *= 2
        lines[1] = json.dumps(entry) + "\n"
        path.write_text("".join(lines))


@pytest.mark.parametrize("how", ["deleted", "emptied", "cut below the ledger", "head cut", "event edited"])
def test_a_damaged_release_log_is_refused_on_resume_naming_it(small_config, tmp_path, how):
    """Before: --resume went on silently, 4 releases uncounted and their 4 noise draws reused."""
    cfg = small_config("rounds=4", f"output_dir={tmp_path / 'run'}")
    run(cfg)
    _damage(cfg.output_dir, how)
    with pytest.raises(ValueError, match=RELEASES):
        run(small_config("rounds=6", f"output_dir={tmp_path / 'run'}"), resume=True)
    assert json.loads((cfg.output_dir / "summary.json").read_text())["rounds_completed"] == 4  # nothing ran


@pytest.mark.parametrize("tail", ["torn line", "lost newline"])
def test_a_crash_while_writing_a_line_is_repaired_before_the_next_record_and_every_later_resume_works(
        small_config, tmp_path, tail):
    """Before: the next record was appended onto the cut line, and every later resume was refused."""
    cfg = small_config("rounds=2", f"output_dir={tmp_path / 'run'}")
    run(cfg)
    path = cfg.output_dir / RELEASES
    if tail == "torn line":  # the crash cut release 3's own line: it was never released
        path.write_text(path.read_text() + '{"release": 3, "round": 3, "ep')
    else:  # the crash cut only release 2's newline: the record is whole, and counted
        path.write_text(path.read_text().rstrip("\n"))
    for rounds in (3, 4):
        summary = run(small_config(f"rounds={rounds}", f"output_dir={tmp_path / 'run'}"), resume=True)
        assert summary["releases"] == rounds
    releases = [json.loads(line)["release"] for line in _log_lines(cfg.output_dir)]
    assert releases == [1, 2, 3, 4]


def test_the_noise_epoch_never_goes_back_below_the_checkpoints(tmp_path):
    """A log whose later epochs were lost cannot make a resume re-key to an epoch already used."""
    event = GaussianRound(1.0, "poisson", 100, 10.0)

    def mechanism():
        return GaussianMechanism(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=10, population=100, seed=0)
    ran = mechanism()
    ran.epoch = 3
    ran.ledger = PrivacyLedger([(event, 2)])
    state = ran.state_dict()
    assert state["noise_epoch"] == 3

    log = ReleaseLog(tmp_path)
    for k in range(3):  # releases 1-3 logged in epoch 0 only: the lines of epochs 1-3 are gone
        log.record(PrivacyLedger([(event, k)] if k else []), k + 1, event, f"d{k}")
    resumed = mechanism()
    resumed.load_state_dict(state)
    assert resumed.attach_release_log(ReleaseLog(tmp_path)) == 1  # release 3 was after the checkpoint
    assert resumed.epoch == 4  # after the checkpoint's 3, not the log's 0 + 1
    fresh = mechanism()
    fresh.epoch = 1
    fresh._seed_generators()
    g_fresh = fresh.release(fresh.aggregator(50), 1).g
    g_resumed = resumed.release(resumed.aggregator(50), 4).g
    assert not torch.equal(g_fresh, g_resumed)


_EVENT = {"noise_multiplier": 1.0, "sampling": "poisson", "population": 100, "expected_cohort": 10.0}
_FIELD_VALUES = st.one_of(st.integers(-3, 5), st.floats(allow_nan=True), st.text(max_size=3), st.none(),
                          st.booleans(), st.lists(st.integers(), max_size=2), st.just(_EVENT))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(
    st.binary(max_size=40),
    st.fixed_dictionaries({k: _FIELD_VALUES for k in ("release", "round", "epoch", "draw", "event")}).map(
        lambda d: json.dumps(d).encode()),
    st.builds(lambda k, e: json.dumps({"release": k, "round": k, "epoch": e, "draw": f"d{k}", "event": _EVENT}).encode(),
              st.integers(1, 4), st.integers(0, 2))), max_size=6), ledger_rounds=st.integers(0, 4))
def test_any_release_log_is_read_or_refused_naming_the_file_never_a_crash(tmp_path, lines, ledger_rounds):
    """Crafted or damaged files: wrong types, non-JSON bytes, lies about positions and epochs."""
    path = tmp_path / RELEASES
    path.write_bytes(b"\n".join(lines))
    event = GaussianRound(**_EVENT)
    try:
        log = ReleaseLog(tmp_path)
        log.check(PrivacyLedger([(event, ledger_rounds)] if ledger_rounds else []), lambda k, e: e == event)
    except ValueError as err:
        assert RELEASES in str(err)
        return
    releases = [e["release"] for e in log.entries]
    assert releases == list(range(1, len(releases) + 1)) and len(releases) >= ledger_rounds
    assert all(type(e["epoch"]) is int and e["epoch"] >= 0 and type(e["release"]) is int for e in log.entries)


def test_a_whole_but_altered_last_record_is_refused_not_dropped_as_torn(tmp_path):
    """Only a line that is not even JSON can be the one a crash cut; a parseable record of the wrong shape
    at the end (no newline) is damage, and dropping it would drop a release."""
    good = {"release": 1, "round": 1, "epoch": 0, "draw": "d1", "event": _EVENT}
    altered = {**good, "release": "2"}
    (tmp_path / RELEASES).write_text(json.dumps(good) + "\n" + json.dumps(altered))
    with pytest.raises(ValueError, match="line 2 is not a release record"):
        ReleaseLog(tmp_path)
