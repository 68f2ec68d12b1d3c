"""examples/flower_datasets: a Flower App whose clients load their data from local Parquet through Flower Datasets
(one NaturalIdPartitioner partition per writer). It must train above its majority baseline under DP with the
client mod's noise and report epsilon, through fedprivacy's public API only."""

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("flwr_datasets")

APP = Path(__file__).parents[2] / "examples" / "flower_datasets"
REPORT = re.compile(r"test accuracy ([\d.]+) \(majority baseline ([\d.]+)\) after \d+ rounds of \d+ of (\d+) writers;"
                    r" epsilon ([\d.]+|inf) \(RDP\), ([\d.]+|inf) \(PLD\)")


@pytest.fixture
def app_task():
    sys.path.insert(0, str(APP))
    try:
        from digit_writers import task
    finally:
        sys.path.remove(str(APP))
    return task


@pytest.mark.slow
def test_distributed_noise_from_the_client_mod_learns_from_the_writers_partitions(tmp_path):
    args = [sys.executable, str(APP / "run.py"), "-q", "-c",
            f"data-dir='{tmp_path}' noise-placement='distributed' num-server-rounds=20"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=APP)
    assert out.returncode == 0, out.stderr[-3000:]
    match = REPORT.search(out.stdout)
    assert match, out.stdout[-2000:]
    accuracy, baseline, writers, eps_rdp, eps_pld = map(float, match.groups())
    assert writers == 100 and baseline == pytest.approx(0.1, abs=0.01)
    assert accuracy > baseline + 0.3
    assert 0 < eps_pld <= eps_rdp < math.inf


def test_each_client_is_exactly_one_writers_records_and_none_is_in_the_test_set(tmp_path, app_task):
    import pandas as pd

    task = app_task.load_task(str(tmp_path), 0)
    train = pd.read_parquet(tmp_path / "train-seed0.parquet")
    test = pd.read_parquet(tmp_path / "test-seed0.parquet")
    assert task.population == train.writer.nunique() == 100 and len(train) + len(test) == 1797
    for i in range(task.population):
        writer = task.partitioner.partition_id_to_natural_id[i]
        rows = train[train.writer == writer]
        x, y = task.load_data(i, 100)
        assert np.array_equal(x.numpy(), np.stack(rows.pixels.to_numpy())) and y.tolist() == rows.digit.tolist()
        assert set(y.tolist()) <= set(app_task.writers_digits(writer))
    with pytest.raises(ValueError, match="num-supernodes=100"):
        task.load_data(0, 10)


def test_the_app_is_a_valid_flower_app(app_task):
    from flwr.cli.config_utils import load_and_validate

    sys.path.insert(0, str(APP))
    try:
        config, _ = load_and_validate(APP / "pyproject.toml", check_module=True)
    finally:
        sys.path.remove(str(APP))
    assert config["tool"]["flwr"]["app"]["components"] == {"serverapp": "digit_writers.server_app:app",
                                                           "clientapp": "digit_writers.client_app:app"}
    assert "federations" not in config["tool"]["flwr"]

