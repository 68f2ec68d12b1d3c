"""examples/tfds_points (docs/YOUR_DATA.md, "TensorFlow Datasets"): the builder writes a TFDS dataset without
TensorFlow, and `fedprivacy run` on the example's config trains on it above its majority baseline."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow_datasets")

EXAMPLE = Path(__file__).parents[2] / "examples" / "tfds_points"


@pytest.mark.slow
def test_the_documented_builder_and_config_train_above_the_majority_baseline(tmp_path):
    for name in ("prepare_points.py", "tfds_points.yaml"):
        shutil.copy(EXAMPLE / name, tmp_path)
    prepared = subprocess.run([sys.executable, "prepare_points.py"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert (tmp_path / "tfds_data" / "user_points" / "1.0.0" / "features.json").is_file()
    ran = subprocess.run([sys.executable, "-m", "fedprivacy", "run", "tfds_points.yaml", "--set", "rounds=10"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "tfds_points" / "summary.json").read_text())
    assert summary["rounds_completed"] == 10 and 0 < summary["epsilon_rdp"] < 10
    assert summary["test_accuracy"] > summary["majority_baseline_accuracy"] + 0.2
    assert json.loads((tmp_path / "runs" / "tfds_points" / "side_information.json").read_text())
