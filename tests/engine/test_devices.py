"""The ``device`` checks, on any machine: config values, engine/device consistency, and the run-start
checks of CUDA and MPS (torch's answers monkeypatched, so the CUDA branches run without a GPU)."""

import logging

import pytest
import torch

from fedprivacy.cli import main
from fedprivacy.client.tensors import host_floats
from fedprivacy.config import ConfigError, build_config
from fedprivacy.devices import DeviceUnavailableError, check_run_device, require_device, worker_gpus


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:3", "mps"])
def test_config_accepts_the_device_values_whatever_this_machine_has(device, fake_gpus):
    fake_gpus(0, build_cuda=None)
    assert build_config({}, [f"device={device}"]).device == device


@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "cuda0", "xla", "cpu:0"])
def test_config_refuses_other_devices_naming_the_field(device):
    with pytest.raises(ConfigError, match=r"device: .*must be cpu, cuda, cuda:N \(N = 0, 1, \.\.\.\) or mps"):
        build_config({"device": device})


def test_ray_with_a_cuda_device_needs_gpu_shares():
    with pytest.raises(ConfigError, match=r"device='cuda' with engine 'ray' needs ray.num_gpus > 0"):
        build_config({}, ["engine=ray", "device=cuda"])
    assert build_config({}, ["engine=ray", "device=cuda", "ray.num_gpus=0.25"]).ray.num_gpus == 0.25
    with pytest.raises(ConfigError, match="device='cuda:1' with engine 'ray': Ray shows each ClientApp"):
        build_config({}, ["engine=ray", "device=cuda:1", "ray.num_gpus=1"])


def test_ray_gpu_shares_for_a_cpu_run_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="fedprivacy.devices"):
        check_run_device(build_config({}, ["engine=ray", "ray.num_gpus=1"]))
    assert "ray.num_gpus=1 reserves GPU shares" in caplog.text and "device 'cpu'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedprivacy.devices"):
        check_run_device(build_config({}, ["engine=ray"]))
    assert caplog.text == ""


def test_cuda_on_a_cpu_build_of_torch_says_how_to_install_one(fake_gpus):
    fake_gpus(0, build_cuda=None)
    with pytest.raises(DeviceUnavailableError, match="device='cuda', but the installed torch .* is a CPU-only build") \
            as err:
        require_device("cuda")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu124" in str(err.value)


def test_cuda_build_without_a_visible_gpu_points_at_the_driver(fake_gpus):
    fake_gpus(0, build_cuda="12.4")
    with pytest.raises(DeviceUnavailableError, match=r"device='cuda:0', but torch .* \(CUDA 12.4\) finds no GPU"):
        require_device("cuda:0")


def test_a_gpu_index_beyond_the_machines_gpus_is_refused(fake_gpus):
    fake_gpus(2)
    require_device("cuda")
    require_device("cuda:1")
    with pytest.raises(DeviceUnavailableError, match=r"device='cuda:2', but torch sees 2 GPU\(s\) here "
                                                     r"\(cuda:0 to cuda:1\)"):
        require_device("cuda:2")


def test_mps_is_checked(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="device='mps', but MPS is not available"):
        require_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    require_device("mps")
    require_device("cpu")


def test_cli_prints_one_line_and_exits_2_before_touching_anything(fake_gpus, tmp_path, capsys):
    fake_gpus(0, build_cuda=None)
    out = tmp_path / "run"
    assert main(["run", "--set", "device=cuda", "--set", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedprivacy: error: device='cuda', but the installed torch")
    assert "Traceback" not in err and err.count("\n") == 1
    assert not out.exists()  # refused before the data, the lock or the output folder


@pytest.mark.parametrize("command", [["audit"], ["deploy", "local", "--supernodes", "2"]])
def test_audit_and_local_deployment_check_the_device_too(command, fake_gpus, capsys):
    fake_gpus(0, build_cuda=None)
    assert main([*command, "--set", "device=cuda"]) == 2
    assert capsys.readouterr().err.startswith("fedprivacy: error: device='cuda', but the installed torch")


def test_cli_names_a_bad_device_value(capsys):
    assert main(["run", "--set", "device=gpu"]) == 2
    err = capsys.readouterr().err
    assert "device: " in err and "must be cpu, cuda, cuda:N" in err and "(got 'gpu')" in err


def test_compare_workers_are_spread_over_the_visible_gpus(fake_gpus, monkeypatch):
    fake_gpus(3)
    assert worker_gpus(["cuda", "cuda"], None) == ["0", "1", "2"]  # default: one worker per GPU
    assert worker_gpus(["cuda:0"], 5) == ["0", "1", "2", "0", "1"]  # worker i: GPU i mod 3
    assert worker_gpus(["cuda"], 2) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,7,GPU-5e1c")  # already restricted: those, in that order
    assert worker_gpus(["cuda"], 4) == ["4", "7", "GPU-5e1c", "4"]
    assert worker_gpus(["cpu", "cpu"], 4) is None  # CPU studies: the caller's default (cores)


def test_compare_refuses_cuda_studies_it_cannot_place(fake_gpus):
    fake_gpus(2)
    with pytest.raises(DeviceUnavailableError, match=r"device='cuda:1': fedprivacy compare gives each worker one GPU"):
        worker_gpus(["cuda", "cuda:1"], None)
    fake_gpus(0, build_cuda=None)
    with pytest.raises(DeviceUnavailableError, match="CPU-only build"):
        worker_gpus(["cpu", "cuda"], None)


def test_host_floats_reads_what_float_reads():
    values = [torch.tensor(0.1), torch.tensor(1e-30), torch.tensor(float("nan"))]
    read = host_floats(values)
    assert read[:2] == [float(v) for v in values[:2]] and read[2] != read[2]
    assert host_floats([]) == []
