"""Shared fixtures: one small synthetic StackOverflow data set per test session, fake GPUs, and the
``flwr`` command with a private local SuperLink."""

import contextlib
import os
import signal
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fedprivacy.config import RunConfig, build_config
from fedprivacy.data.synthetic import generate


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """40 training users in TFF's SQLite format (generated once per session), about a tenth of TFF's
    user size (mean 40 examples, at least 1) so that the suite stays fast; the TFF-shaped sizes have
    their own tests in tests/data/test_synthetic.py."""
    out = tmp_path_factory.mktemp("so40")
    generate(out, num_clients=40, seed=1, min_examples=1, mean_examples=40, max_examples=800)
    return out


@pytest.fixture
def small_config(small_data, tmp_path):
    """A fast config on the small data: 2,000-word vocabulary, 50 tags (100,050 parameters)."""

    def make(*overrides: str) -> RunConfig:
        base = {
            "rounds": 2, "eval_every": 1, "checkpoint_every": 1, "output_dir": str(tmp_path / "run"),
            "data": {"path": str(small_data), "generate_if_missing": False, "vocab_size": 2000, "num_tags": 50},
            "client": {"epochs": 1, "batch_size": 10, "lr": 5.0},
            "privacy": {"clip_norm": 1.0, "noise_multiplier": 0.5, "expected_cohort": 8, "accountants": ["rdp", "pld"]},
        }
        return build_config(base, list(overrides))

    return make


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(n, build_cuda="12.4")``: torch reports ``n`` GPUs (0: CUDA unavailable), from a CUDA
    build (``build_cuda=None``: a CPU-only build), and ``CUDA_VISIBLE_DEVICES`` is unset."""

    def fake(n: int, build_cuda: str | None = "12.4") -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.version, "cuda", build_cuda)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return fake


def _local_superlinks(control_port: int) -> list[int]:
    """Pids of the flower-superlink processes `flwr run` started for this control port (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"flower-superlink") for a in argv[:2]) and f"127.0.0.1:{control_port}".encode() in argv:
            pids.append(int(entry))
    return pids


@pytest.fixture
def flwr_cli(tmp_path):
    """``(flwr, env)``: the ``flwr`` next to this Python and an environment whose managed local SuperLink
    listens on free ports with its own FLWR_HOME; every SuperLink it started is stopped afterwards."""
    from fedprivacy.deploy.local import descendants, free_ports

    if sys.platform != "linux":
        pytest.skip("finds the local SuperLink through /proc")
    flwr = Path(sys.executable).parent / "flwr"
    if not flwr.exists() or shutil.which("flower-superlink", path=str(flwr.parent)) is None:
        pytest.skip("flwr is not installed next to this Python")
    http_port, control_port = free_ports(2)
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port), "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
           "PATH": f"{flwr.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    yield flwr, env
    for pid in _local_superlinks(control_port):
        for p in [pid, *descendants(pid)]:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(p, signal.SIGTERM)
