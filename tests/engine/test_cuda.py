"""The CUDA path, on a machine with a GPU (skipped cleanly elsewhere; ``pytest -m cuda`` selects these).

Without noise a CUDA run must train the CPU run's model (up to float rounding: the GPU's kernels
sum in another order); with noise its generator must be on the GPU, and the sample-DP clients must
train there. The device checks themselves are tested anywhere in ``test_devices.py``.
"""

import math
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedprivacy.client.sample_dp import run_sample_dp, train_sample_dp, train_sample_dp_softmax
from fedprivacy.optim.sample_dp import SampleDPConfig
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")]

GPU = "cuda"
NOISELESS = ("privacy.noise_multiplier=0", "privacy.sampling=fixed", "privacy.accountants=[rdp]", "client.epochs=2")


def _final_model(cfg) -> dict[str, torch.Tensor]:
    return torch.load(cfg.output_dir / "final_model.pt", map_location="cpu")


@pytest.mark.parametrize("task", ["tag", "tag_multilabel"])  # row-local closed-form SGD; autograd on sparse rows
def test_two_round_dp_fedavg_on_cuda_trains_the_cpu_model(small_config, tmp_path, task):
    runs = {side: small_config(*NOISELESS, f"data.task={task}", f"device={device}", f"output_dir={tmp_path / side}")
            for side, device in (("cpu", "cpu"), ("gpu", GPU))}
    summaries = {side: run(cfg) for side, cfg in runs.items()}
    cpu, gpu = _final_model(runs["cpu"]), _final_model(runs["gpu"])
    assert summaries["gpu"]["rounds_completed"] == 2
    assert any(v.abs().max() > 0 for v in cpu.values())  # it trained
    for name in cpu:
        assert torch.allclose(gpu[name], cpu[name], rtol=1e-4, atol=1e-6), name


def test_noisy_run_on_cuda_draws_its_noise_on_the_gpu(small_config, tmp_path):
    noise = GaussianNoise(0, device=GPU)
    assert noise._gen.device.type == GPU
    target = torch.zeros(1000, device=GPU)
    noise.add_(target, 2.0)
    assert target.device.type == GPU and 1.5 < float(target.std()) < 2.5
    cfg = small_config(f"device={GPU}", f"output_dir={tmp_path / 'noisy'}")
    assert run(cfg)["rounds_completed"] == 2
    assert all(torch.isfinite(v).all() for v in _final_model(cfg).values())


@pytest.mark.parametrize("disk", [{}, {"disk_kappa": 0.7, "disk_gamma": 0.5}])
def test_sample_dp_softmax_client_on_cuda(small_config, disk):
    task = load_task(small_config().data)
    features, labels = task.client_data(0)
    cfg = SampleDPConfig(base="adam", lr=0.05, noise_multiplier=0.0, clip_norm=0.5, batch_size=4.0, **disk)
    cpu = train_sample_dp_softmax(task.new_model("cpu"), features, labels, cfg, 11, epochs=1.0)
    gpu = train_sample_dp_softmax(task.new_model(GPU), features, labels, cfg, 11, epochs=1.0)
    assert gpu.delta.device.type == GPU and gpu.steps == cpu.steps and gpu.epsilon == cpu.epsilon
    assert cpu.delta.abs().max() > 0
    assert torch.allclose(gpu.delta.cpu(), cpu.delta, rtol=1e-4, atol=1e-6)
    assert gpu.train_loss == pytest.approx(cpu.train_loss, rel=1e-5)
    noisy = train_sample_dp_softmax(task.new_model(GPU), features, labels,
                                    SampleDPConfig(noise_multiplier=1.0, batch_size=4.0), 11, epochs=1.0)
    assert noisy.delta.device.type == GPU and torch.isfinite(noisy.delta).all() and math.isfinite(noisy.epsilon)


def test_sample_dp_opacus_client_on_cuda():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=gen), torch.randint(0, 2, (40,), generator=gen)
    cfg = SampleDPConfig(base="sgd", lr=0.5, noise_multiplier=0.0, clip_norm=1.0, batch_size=8.0, micro_batch_size=2)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))

    cpu = train_sample_dp(model(), TensorDataset(x, y), cfg, 3, epochs=2.0)
    gpu = train_sample_dp(model().to(GPU), TensorDataset(x, y), cfg, 3, epochs=2.0)  # records stay on the host
    assert gpu.delta.device.type == GPU and cpu.delta.abs().max() > 0
    assert torch.allclose(gpu.delta.cpu(), cpu.delta, rtol=1e-4, atol=1e-6)
    assert gpu.train_loss == pytest.approx(cpu.train_loss, rel=1e-5)
    noisy = run_sample_dp(model().to(GPU), TensorDataset(x, y), replace(cfg, noise_multiplier=1.0), 3, epochs=1.0,
                          loss_fn=lambda out, target: nn.functional.cross_entropy(out, target, reduction="none"))
    assert noisy.optimizer.generator.device.type == GPU  # the noise is drawn where the gradients are
    assert all(torch.isfinite(p).all() for p in noisy.optimizer.params)


def test_federated_sample_dp_run_on_cuda(small_config, tmp_path):
    cfg = small_config(f"device={GPU}", "client.sample_dp={optimizer: sgd, lr: 0.05, batch_size: 4, epochs: 0.5}",
                       f"output_dir={tmp_path / 'sdp'}")
    assert run(cfg)["rounds_completed"] == 2
    assert all(torch.isfinite(v).all() for v in _final_model(cfg).values())
