"""metrics.csv: rows appended one line at a time read back exactly as a full rewrite writes them."""

import math

import pandas as pd

from fedprivacy.config import build_config
from fedprivacy.outputs import RunOutputs


def _outputs(tmp_path):
    out = RunOutputs(build_config({"output_dir": str(tmp_path / "run")}))
    out.prepare(resume=False)
    return out


def _row(t, **extra):
    return {"round": t, "train_loss": 1 / 3 + t, "test_accuracy": float("nan"), "epsilon_rdp": 1e-7 * t,
            "seconds": math.inf if t == 2 else 0.1 * t, **extra}


def test_appended_rows_equal_a_full_rewrite(tmp_path):
    out = _outputs(tmp_path)
    for t in range(1, 5):
        out.log_round(_row(t))
    appended = (out.dir / "metrics.csv").read_text()
    out._write_metrics()  # what writing every row at once gives
    assert appended == (out.dir / "metrics.csv").read_text()
    df = pd.read_csv(out.dir / "metrics.csv")
    assert list(df["round"]) == [1, 2, 3, 4] and df["test_accuracy"].isna().all()
    assert df["train_loss"].tolist() == [1 / 3 + t for t in range(1, 5)]  # full precision


def test_a_row_with_new_columns_rewrites_the_file_with_them(tmp_path):
    out = _outputs(tmp_path)
    out.log_round(_row(1))
    out.log_round(_row(2, test_loss=0.5))  # a new column: every earlier row gets an empty cell
    out.log_round(_row(3, test_loss=0.25))
    df = pd.read_csv(out.dir / "metrics.csv")
    assert list(df.columns) == [*_row(1), "test_loss"]
    assert math.isnan(df["test_loss"][0]) and df["test_loss"].tolist()[1:] == [0.5, 0.25]
