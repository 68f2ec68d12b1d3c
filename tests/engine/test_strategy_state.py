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

from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.fl.strategy_state import STATE
from fedprivacy.outputs import ResumeError
from fedprivacy.privacy.accounting import PrivacyLedger
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
    import json, sys, time
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from fedprivacy.engines.inprocess import run_inprocess
    from fedprivacy import SecureAggregation, secure_aggregation_mod
    from fedprivacy.fl.strategy import DPFedAvg
    from fedprivacy.fl.strategy_state import StrategyState
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

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        secure = dict(placement="distributed", secure_aggregation=SecureAggregation(threshold=2, neighbours=3),
                      accountants=("rdp",)) if sys.argv[3] == "secure" else {}
        strategy = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, delta=1e-3,
                            state_dir=sys.argv[1], **secure)  # the deployment default: cohort and noise from the OS
        strategy.start(grid=grid, initial_arrays=ArrayRecord(_model().state_dict()), num_rounds=int(sys.argv[2]),
                       train_config=ConfigRecord({"lr": 0.5}))
        print(json.dumps({"round": strategy.round, "releases": strategy.mechanism.ledger.rounds,
                          "epsilon": strategy.epsilons()["rdp"]}))

    mods = [secure_aggregation_mod(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, bits=20, threshold=2,
                                   neighbours=3)]
    run_inprocess(app, _plain_client_app(slow, mods=mods if sys.argv[3] == "secure" else None), 8)
''')


@pytest.mark.parametrize("mode", ["central", "secure"])
def test_kill_9_at_random_moments_then_restart_never_under_counts_and_never_reuses_a_draw(tmp_path, mode):
    """``secure``: SecAgg+ with the clients' Skellam shares; the server draws nothing, every logged release is a
    Skellam round and is accounted."""
    script = tmp_path / "server_app.py"
    script.write_text(_APP)
    state, rounds, rng = tmp_path / "state", 12, random.Random()

    def launch():
        return subprocess.Popen([sys.executable, str(script), str(state), str(rounds), mode], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    for kill in range(3):
        proc = launch()
        logged = len(ReleaseLog(state).entries) if (state / RELEASES).exists() else 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # past one more release, then at random
            if (state / RELEASES).exists() and len(ReleaseLog(state).entries) > logged:
                break
            time.sleep(0.01)
        # the first kill lands between a logged release and its checkpoint; the others anywhere in a round
        time.sleep(0.05 if kill == 0 else rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    out, _ = launch().communicate(timeout=300)
    final = json.loads(out.strip().splitlines()[-1])
    entries = ReleaseLog(state).entries
    saved = torch.load(state / STATE, weights_only=False)
    ledger = PrivacyLedger.from_state_dict(saved["ledger"])
    assert final["round"] == saved["round"] == rounds
    assert ledger.rounds == len(entries) == final["releases"] >= rounds  # every logged release is accounted
    draws = [e["draw"] for e in entries]
    if mode == "secure":  # no server draw; each release the survivors' Skellam shares
        assert set(draws) == {None} and all(type(e["event"]).__name__ == "SkellamRound" for e in entries)
    else:
        assert len(set(draws)) == len(draws)  # no noise draw released twice
    assert [e["release"] for e in entries] == list(range(1, len(entries) + 1))
    assert len(entries) > rounds and max(e["epoch"] for e in entries) >= 1  # a lost release was accounted
