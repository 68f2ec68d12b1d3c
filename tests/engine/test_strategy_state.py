"""``DPFedAvg(state_dir=...)``: a stock Flower ServerApp that dies is started again without under-counting
(issue "One round, one orchestrator", item 2)."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fedprivacy.checkpoints import ResumeError
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.fl.strategy_state import STATE
from fedprivacy.privacy.accounting import PrivacyLedger, epsilon
from fedprivacy.privacy.release_log import RELEASES, ReleaseLog

from test_strategy import _flat, _plain_client_app, _start  # this folder is on sys.path (pytest's rootdir mode)

SETTINGS = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, optimizer="adam", lr=0.05,
                optimizer_settings={"tau": 1e-3}, delta=1e-3)


def test_a_restart_on_the_state_dir_continues_the_run_bit_exactly_with_its_ledger(tmp_path):
    uninterrupted = DPFedAvg(**SETTINGS, seed=0)
    full = _start(uninterrupted, _plain_client_app(), 8, rounds=5, lr=0.5)
    first = DPFedAvg(**SETTINGS, seed=0, state_dir=tmp_path)
    _start(first, _plain_client_app(), 8, rounds=2, lr=0.5)
    restarted = DPFedAvg(**SETTINGS, seed=0, state_dir=tmp_path)  # a new process would build it the same way
    result = _start(restarted, _plain_client_app(), 8, rounds=5, lr=0.5)
    assert torch.equal(_flat(result.arrays), _flat(full.arrays))
    assert restarted.round == 5 and restarted.mechanism.ledger.rounds == 5
    assert restarted.epsilons() == uninterrupted.epsilons()
    assert sorted(result.train_metrics_clientapp) == [3, 4, 5]  # rounds numbered from the run's start
    assert torch.equal(_flat(restarted.arrays), _flat(full.arrays))
    done = DPFedAvg(**SETTINGS, seed=0, state_dir=tmp_path)
    again = _start(done, _plain_client_app(), 8, rounds=5, lr=0.5)  # nothing left to run
    assert torch.equal(_flat(again.arrays), _flat(full.arrays)) and done.mechanism.ledger.rounds == 5


@pytest.mark.parametrize(("change", "field"), [({"noise_multiplier": 2.0}, "noise_multiplier: 1.0 -> 2.0"),
                                               ({"delta": 1e-4}, "delta: 0.001 -> 0.0001"),
                                               ({"seed": None}, "seed: 0 -> None"),
                                               ({"optimizer": "yogi"}, "optimizer: 'adam' -> 'yogi'")])
def test_a_restart_with_changed_settings_is_refused_naming_the_field(tmp_path, change, field):
    _start(DPFedAvg(**SETTINGS, seed=0, state_dir=tmp_path), _plain_client_app(), 8, rounds=1, lr=0.5)
    with pytest.raises(ResumeError, match=field.replace("(", r"\(")):
        DPFedAvg(**{**SETTINGS, "seed": 0, **change}, state_dir=tmp_path)


_APP = textwrap.dedent('''
    import json, os, sys, time, traceback
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from fedprivacy.engines.inprocess import run_inprocess
    from fedprivacy import SecureAggregation, answer_identity_query, secure_aggregation_mod
    from fedprivacy.fl.strategy import DPFedAvg
    from fedprivacy.fl.strategy_state import StrategyState
    from fedprivacy.privacy.correlated import CorrelatedMechanism
    from test_strategy import _model, _plain_client_app

    save = StrategyState.save

    def slow_save(self, *args):  # a slow disk: a wide window between a round's release and its checkpoint
        time.sleep(0.3)
        save(self, *args)

    StrategyState.save = slow_save

    def slow(content):
        time.sleep(0.03)  # a round of a few clients takes a fraction of a second: a kill lands mid-round
        return content

    app = ServerApp()
    ARGS: list[str] = []  # a run's: state_dir, rounds, mode (central, secure), noise stream, seed

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        secure = dict(placement="distributed", secure_aggregation=SecureAggregation(threshold=2, neighbours=3),
                      accountants=("rdp",)) if ARGS[2] == "secure" else {}
        correlated = {} if ARGS[3] == "independent" else dict(  # horizon 4: the rounds cross a restart
            expected_cohort=2, sampling="min_separated", groups=2,
            noise_stream=CorrelatedMechanism(kind=ARGS[3], horizon=4, groups=2, bands=2, buffers=2))
        seed = None if ARGS[4] == "os" else int(ARGS[4])  # the deployment default: cohort and noise from the OS
        strategy = DPFedAvg(**{**dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8,
                                      delta=1e-3, state_dir=ARGS[0], seed=seed), **secure, **correlated})
        strategy.start(grid=grid, initial_arrays=ArrayRecord(_model().state_dict()), num_rounds=int(ARGS[1]),
                       train_config=ConfigRecord({"lr": 0.5}))
        print(json.dumps({"round": strategy.round, "releases": strategy.mechanism.ledger.rounds,
                          "epsilon": strategy.epsilons()["rdp"]}))

    mods = [secure_aggregation_mod(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, bits=20, threshold=2,
                                   neighbours=3)]
    for line in sys.stdin:  # one line, one server process: forked once the imports are done, before anything ran
        ARGS[:] = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                client = _plain_client_app(slow, mods=mods if ARGS[2] == "secure" else None)
                run_inprocess(app, answer_identity_query(client), 8)  # a min-separated state asks for identities
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush()
            os._exit(0)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("exited", flush=True)
''')


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The parent of :data:`_APP`'s server processes: each is a process of its own, forked after the imports (an
    import takes seconds on a busy machine)."""
    script = tmp_path_factory.mktemp("app") / "server_app.py"
    script.write_text(_APP)
    here = Path(__file__)
    with open(script.parent / "stderr.txt", "w") as stderr:
        parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=stderr, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      [str(here.parent), str(here.parents[2])])})
        yield parent
        parent.communicate(timeout=60)


def _kill_9_and_restart(servers, tmp_path, rounds: int, kills: int, *args: str) -> tuple[dict, list[dict], PrivacyLedger]:
    """Run a server of :data:`_APP` (``args``: mode, noise stream, seed), kill it ``kills`` times, then let it
    finish; returns its last line, the release log's records and the final checkpoint's ledger."""
    state, rng = tmp_path / "state", random.Random()

    def launch() -> int:
        servers.stdin.write(" ".join([str(state), str(rounds), *args]) + "\n")
        servers.stdin.flush()
        return int(servers.stdout.readline())
    for kill in range(kills):
        pid = launch()
        logged = len(ReleaseLog(state).entries) if (state / RELEASES).exists() else 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # past one more release, then at random
            if (state / RELEASES).exists() and len(ReleaseLog(state).entries) > logged:
                break
            time.sleep(0.01)
        # the first kill lands between a logged release and its checkpoint; the others anywhere in a round
        time.sleep(0.05 if kill == 0 else rng.uniform(0.0, 0.6))
        os.kill(pid, signal.SIGKILL)
        assert servers.stdout.readline() == "exited\n"
    launch()
    out = []
    while (line := servers.stdout.readline()) not in ("exited\n", ""):
        out.append(line)
    assert out, (Path(servers.args[1]).parent / "stderr.txt").read_text()[-3000:]  # the server did not finish
    final = json.loads(out[-1])
    entries = ReleaseLog(state).entries
    saved = torch.load(state / STATE, weights_only=False)
    ledger = PrivacyLedger.from_state_dict(saved["ledger"])
    assert final["round"] == saved["round"] == rounds
    assert ledger.rounds == len(entries) == final["releases"] >= rounds  # every logged release is accounted
    assert [e["release"] for e in entries] == list(range(1, len(entries) + 1))
    for before, entry in zip(entries, entries[1:]):  # a round run again: by a resume that began a new epoch
        assert entry["round"] > before["round"] or entry["epoch"] > before["epoch"]
    return final, entries, ledger


@pytest.mark.parametrize("mode", ["central", "secure"])
def test_kill_9_at_random_moments_then_restart_never_under_counts_and_never_reuses_a_draw(servers, tmp_path, mode):
    """``secure``: SecAgg+ with the clients' Skellam shares; the server draws nothing, every logged release is a
    Skellam round and is accounted."""
    rounds = 12
    final, entries, ledger = _kill_9_and_restart(servers, tmp_path, rounds, 3, mode, "independent", "os")
    draws = [e["draw"] for e in entries]
    if mode == "secure":  # no server draw; each release the survivors' Skellam shares
        assert set(draws) == {None} and all(type(e["event"]).__name__ == "SkellamRound" for e in entries)
    else:
        assert len(set(draws)) == len(draws)  # no noise draw released twice
    # a lost release was accounted: some round was released twice, by two epochs (counting entries against rounds
    # would miss it where a secure round aborts under load and releases nothing)
    assert len(entries) > len({e["round"] for e in entries}) and max(e["epoch"] for e in entries) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["os", "0"])
@pytest.mark.parametrize("stream", ["tree", "bandmf", "blt"])
def test_kill_9_of_a_correlated_run_then_restart_accounts_every_logged_release(servers, tmp_path, stream, seed):
    """Before: with noise from the OS, a kill between a logged release and its checkpoint left a run that could
    never resume (the lost release was checked against a new stream's first release)."""
    rounds = 8
    final, entries, ledger = _kill_9_and_restart(servers, tmp_path, rounds, 2, "central", stream, seed)
    logged = PrivacyLedger()
    for entry in entries:
        logged.compose(entry["event"])
    assert ledger.entries == logged.entries and final["epsilon"] >= epsilon(logged, 1e-3, "rdp")
    draws = [e["draw"] for e in entries]
    assert None not in draws and len(set(draws)) == len(draws)  # seeded: re-keyed by the epoch
    assert len(entries) > rounds  # the first kill lands between a logged release and its checkpoint
