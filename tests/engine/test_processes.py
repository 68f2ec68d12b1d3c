"""Worker processes for the in-process engine (``processes > 1``): the same replies in the same
order as one process, so the same model bit for bit; node state kept with the grid; a worker that
dies is a dropout, never a crashed or hung run."""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
import yaml
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedprivacy.config import ConfigError, build_config
from fedprivacy.engines.inprocess import InProcessGrid, run_inprocess
from fedprivacy.engines import processes
from fedprivacy.engines.processes import WORKER_DIED
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.server_app import build_server_app
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task


def _identity() -> None:
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1


PARENT = os.getpid()
PARENT_PACE_S = 0.02
"""Each client run in the test's own process takes this long, so a forked worker that starts late on
a loaded machine still claims some of a batch (the tests below need both processes to run clients)."""


@pytest.fixture(autouse=True)
def _always_fan_out(monkeypatch):
    """These tests are about the workers: every batch goes to them (the speed rule would keep small,
    fast batches here; its own test sets it back)."""
    monkeypatch.setattr(processes, "FAN_OUT_FACTOR", 0.0)


def _echo_app() -> ClientApp:
    """Replies with its node, the pid that ran it and how often this node ran (kept in its state);
    raises for node 5."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        if os.getpid() == PARENT:
            time.sleep(PARENT_PACE_S)
        if msg.metadata.dst_node_id == 5:
            raise RuntimeError("node 5 always fails")
        seen = int(context.state["count"]["n"]) + 1 if "count" in context.state else 1
        context.state["count"] = ConfigRecord({"n": seen})
        return Message(RecordDict({"r": ConfigRecord({"node": msg.metadata.dst_node_id, "pid": os.getpid(),
                                                       "seen": seen})}), reply_to=msg)

    return app


def _batch(nodes) -> list[Message]:
    return [Message(RecordDict(), dst_node_id=n, message_type="train") for n in nodes]


def test_replies_come_in_message_order_from_both_processes_and_state_stays_with_the_grid():
    _identity()
    with InProcessGrid(_echo_app(), num_nodes=40, processes=2) as grid:
        nodes = list(range(2, 42))
        for round_ in (1, 2, 3):
            replies = list(grid.send_and_receive(_batch(nodes)))
            assert [r.metadata.src_node_id for r in replies] == nodes
            ok = [r for r in replies if not r.has_error()]
            assert [r.content["r"]["seen"] for r in ok] == [round_] * 39  # state carried wherever it ran
            assert replies[3].has_error() and "node 5 always fails" in replies[3].error.reason
        assert len({r.content["r"]["pid"] for r in ok}) == 2  # both processes ran clients
        assert sorted(grid.node_state_dict()) == [n for n in nodes if n != 5]
        assert grid._pool.workers_alive == 1
    assert grid._pool is None


@pytest.mark.parametrize("factor, ran_here_only", [(1e9, True), (0.0, False)])
def test_a_batch_too_small_to_pay_its_hand_over_runs_here_with_the_same_replies(monkeypatch, factor, ran_here_only):
    """Once a client's time and the hand-over are measured, a batch whose serial time is under
    FAN_OUT_FACTOR hand-overs runs in the grid's process alone; the replies and node states are the same."""
    _identity()
    monkeypatch.setattr(processes, "FAN_OUT_FACTOR", factor)
    nodes = list(range(6, 26))
    with InProcessGrid(_echo_app(), num_nodes=30, processes=2) as grid:
        first = list(grid.send_and_receive(_batch(nodes)))  # nothing measured yet: fanned out
        assert len({r.content["r"]["pid"] for r in first}) == 2
        second = list(grid.send_and_receive(_batch(nodes)))
        assert ({r.content["r"]["pid"] for r in second} == {os.getpid()}) is ran_here_only
        assert [(r.metadata.src_node_id, r.content["r"]["seen"]) for r in second] == [(n, 2) for n in nodes]


def test_an_abandoned_batch_leaves_the_pool_usable():
    _identity()
    with InProcessGrid(_echo_app(), num_nodes=60, processes=2) as grid:
        for _ in range(3):  # more abandoned batches than the window has slots
            it = grid.send_and_receive(_batch(range(10, 60)))
            assert next(it).metadata.src_node_id == 10
            it.close()
        replies = list(grid.send_and_receive(_batch(range(10, 60))))
        assert [r.metadata.src_node_id for r in replies] == list(range(10, 60))


def test_a_worker_that_dies_is_one_dropout_and_the_rest_run_here():
    _identity()
    parent = os.getpid()
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        if os.getpid() != parent:
            os._exit(3)  # the worker process is killed while running this client
        time.sleep(PARENT_PACE_S)
        return Message(RecordDict({"r": ConfigRecord({"node": msg.metadata.dst_node_id})}), reply_to=msg)

    with InProcessGrid(app, num_nodes=30, processes=2) as grid:
        replies = list(grid.send_and_receive(_batch(range(2, 32))))
        assert [r.metadata.src_node_id for r in replies] == list(range(2, 32))
        failed = [r for r in replies if r.has_error()]
        assert len(failed) == 1 and failed[0].error.code == WORKER_DIED
        assert grid._pool.workers_alive == 0
        assert not any(r.has_error() for r in grid.send_and_receive(_batch(range(2, 32))))


def _final(cfg) -> torch.Tensor:
    state = torch.load(cfg.output_dir / "final_model.pt")
    return torch.cat([state[k].reshape(-1) for k in sorted(state)])


def _metrics(cfg) -> pd.DataFrame:
    return pd.read_csv(cfg.output_dir / "metrics.csv").drop(columns="seconds")


@pytest.mark.parametrize("options", [
    (),
    ("client.compression={density: 0.02, quantization: 4bit_stochastic, bucket_size: 1000}",),  # node state
], ids=["dp-fedavg", "compressed-uploads-with-residuals"])
def test_two_processes_train_the_bit_identical_model(small_config, tmp_path, options):
    one = small_config("rounds=3", *options, f"output_dir={tmp_path / 'one'}")
    two = small_config("rounds=3", *options, "processes=2", f"output_dir={tmp_path / 'two'}")
    run(one)
    run(two)
    assert torch.equal(_final(one), _final(two))
    pd.testing.assert_frame_equal(_metrics(one), _metrics(two))
    ck_one, ck_two = (torch.load(c.output_dir / "checkpoint.pt", weights_only=False) for c in (one, two))
    assert sorted(ck_one["node_states"]) == sorted(ck_two["node_states"])  # residuals kept with the grid
    if options:
        assert ck_one["node_states"]


def test_a_dead_worker_in_a_run_is_a_dropout_with_unchanged_accounting(small_config, tmp_path):
    cfg = small_config("rounds=3", "privacy.sampling=fixed", "privacy.accountants=[rdp]", "processes=2", f"output_dir={tmp_path / 'two'}")
    ref = small_config("rounds=3", "privacy.sampling=fixed", "privacy.accountants=[rdp]", f"output_dir={tmp_path / 'one'}")
    parent = os.getpid()

    def die_in_worker(msg, context, call_next):
        if os.getpid() != parent and msg.metadata.message_type == "train":
            os._exit(3)
        return call_next(msg, context)

    run_inprocess(build_server_app(cfg), build_client_app(cfg, mods=[die_in_worker]), load_task(cfg.data).population,
                  processes=2)
    run(ref)
    got, want = _metrics(cfg), _metrics(ref)
    assert got["cohort_accepted"].tolist() == [want["cohort_accepted"][0] - 1, *want["cohort_accepted"][1:]]
    pd.testing.assert_series_equal(got["epsilon_rdp"], want["epsilon_rdp"])  # dropouts change no accounting
    assert (got["server_noise_std"] == want["server_noise_std"]).all()


@pytest.mark.parametrize("overrides, field", [
    (["processes=2", "engine=ray"], "processes"),
    (["processes=2", "device=cuda"], "processes"),
    (["processes=0"], "processes"),
])
def test_processes_that_cannot_work_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        build_config({}, overrides)


@pytest.mark.parametrize("out_of_band", [1 << 30, 10_000])  # every payload in the pickle / large ones in the ring
@pytest.mark.parametrize("reply_bytes", [[40_000], [100_000], [30_000, 30_000]])
def test_replies_larger_than_the_ring_wrap_around_or_go_through_the_pipe(monkeypatch, reply_bytes, out_of_band):
    """A 200 KB ring: 40 KB replies wrap it many times; a 100 KB one is over a quarter of it (through
    the pipe); with payloads from 10 KB copied into the ring directly, the second 30 KB blob is over
    the reply's share of the ring (50 KB) and stays in the pickle."""
    _identity()
    monkeypatch.setattr(processes, "RING_BYTES", 200_000)
    monkeypatch.setattr(processes, "OUT_OF_BAND_BYTES", out_of_band)
    app = ClientApp()

    def blobs(node: int) -> dict[str, bytes]:
        return {f"blob{j}": bytes([(node + j) % 251]) * size for j, size in enumerate(reply_bytes)}

    @app.train()
    def train(msg: Message, context) -> Message:
        return Message(RecordDict({"r": ConfigRecord(blobs(msg.metadata.dst_node_id))}), reply_to=msg)

    with InProcessGrid(app, num_nodes=80, processes=2) as grid:
        for _ in range(2):
            replies = list(grid.send_and_receive(_batch(range(2, 82))))
            assert [dict(r.content["r"]) for r in replies] == [blobs(n) for n in range(2, 82)]


def _stat(pid: int | str) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return None
    return state, int(ppid)


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"  # a zombie has exited


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker in /proc")
def test_a_worker_dies_with_its_killed_parent(small_config, tmp_path):
    """``kill -9`` of a ``processes: 2`` run leaves no worker behind (it would hold its memory until killed)."""
    cfg = small_config("rounds=100000", "processes=2")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(json.loads(cfg.to_json())))
    proc = subprocess.Popen([sys.executable, "-m", "fedprivacy", "run", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (cfg.output_dir / "checkpoint.pt").exists() and time.time() < deadline:
            time.sleep(0.1)
        (worker,) = [int(p) for p in os.listdir("/proc") if p.isdigit() and (_stat(p) or ("", 0))[1] == proc.pid]
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 5
    while _alive(worker) and time.time() < deadline:
        time.sleep(0.05)
    if _alive(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the worker outlived its killed parent by 5 s")


def test_more_processes_than_cores_warn_naming_the_field_and_the_cores(monkeypatch, caplog):
    _identity()
    monkeypatch.setattr(processes, "usable_cores", lambda: 1)
    with caplog.at_level("WARNING", logger=processes.__name__), InProcessGrid(_echo_app(), num_nodes=4, processes=2):
        pass
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "processes=2" in warning and "1 CPU cores" in warning


def test_a_run_uses_every_usable_core_unless_told_otherwise(monkeypatch):
    from fedprivacy.config import build_config
    from fedprivacy.engines.processes import run_processes

    monkeypatch.setattr(processes, "usable_cores", lambda: 6)
    assert run_processes(build_config({})) == 6
    assert run_processes(build_config({"processes": 1})) == 1
    assert run_processes(build_config({"engine": "ray"})) == 1
    assert run_processes(build_config({"device": "cuda"})) == 1
