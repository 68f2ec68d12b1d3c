"""A run's folder: metrics.csv rows appended one line at a time read back exactly as a full rewrite
writes them; the plot draws each epsilon through the rounds that report it; resuming refuses what would break the run; failed writes and a held folder say what
and where in one line."""

import errno
import json
import math
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fedprivacy.checkpoints import ResumeError
from fedprivacy.cli import describe_os_error
from fedprivacy.config import build_config
from fedprivacy.locks import FolderBusyError
from fedprivacy.fl.strategy_state import StrategyState
from fedprivacy.outputs import CHECKPOINT, RunOutputs, fixed_settings, plot_metrics, run_lock
from fedprivacy.run import run


def test_the_plot_draws_each_epsilon_through_the_rounds_that_report_it(tmp_path, monkeypatch):
    """The accountants other than the budget's are NaN at unevaluated rounds: a line through every round would
    show none of their points (matplotlib breaks a line at each NaN)."""
    from matplotlib.axes import Axes

    drawn: dict[str, tuple[list, list]] = {}
    plot = Axes.plot

    def recording(self, x, y, *args, **kwargs):
        drawn[kwargs.get("label", "")] = (list(x), list(y))
        return plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording)
    nan = float("nan")
    rows = pd.DataFrame({"round": [1, 2, 3, 4], "test_accuracy": [nan, 0.1, nan, 0.2],
                         "epsilon_rdp": [1.0, 1.5, 1.9, 2.2], "epsilon_pld": [nan, 1.2, nan, 1.8]})
    plot_metrics(rows, tmp_path / "metrics.png")
    assert drawn["rdp"] == ([1, 2, 3, 4], [1.0, 1.5, 1.9, 2.2]) and drawn["pld"] == ([2, 4], [1.2, 1.8])
    assert (tmp_path / "metrics.png").stat().st_size > 0


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


def _save(out: RunOutputs, t: int) -> None:
    """The run's checkpoint of round ``t`` as its strategy writes it: its fixed settings, rows and config."""
    StrategyState(out.dir).save(_fixed(out), {"round": t, "metrics": out.rows, "config": out.cfg.to_json()})


def _fixed(out: RunOutputs) -> dict:
    return fixed_settings(json.loads(out.cfg.to_json()))


def _resume(out: RunOutputs) -> dict | None:
    """What a resume of ``out``'s config does with the folder: checked, config.yaml written, the state loaded."""
    out.prepare(resume=True)
    return StrategyState(out.dir).load(_fixed(out))


def _checkpointed(tmp_path, **tree) -> RunOutputs:
    """A run folder holding a checkpoint of round 1 (as the server writes it) under the config ``tree``."""
    out = RunOutputs(build_config({"output_dir": str(tmp_path / "run"), **tree}))
    out.prepare(resume=False)
    out.log_round(_row(1))
    _save(out, 1)
    return out


@pytest.mark.parametrize("override, fields", [
    ("privacy.noise_multiplier=2.0", ["privacy.noise_multiplier"]),
    ("privacy.adaptive_clipping={target_quantile: 0.5}", ["privacy.adaptive_clipping"]),
    ("seed=7", ["seed"]),
    ("data.vocab_size=100", ["data.vocab_size"]),
    ("data.task=next_word", ["data.task"]),
])
def test_resume_refuses_a_changed_privacy_setting_seed_or_model_shape_naming_it(tmp_path, override, fields):
    _checkpointed(tmp_path)
    changed = RunOutputs(build_config({"output_dir": str(tmp_path / "run")}, [override]))
    with pytest.raises(ResumeError, match="holds a run started with other settings") as err:
        _resume(changed)
    assert all(f in str(err.value) for f in fields)


def test_resume_writes_allowed_changes_to_config_yaml(tmp_path):
    _checkpointed(tmp_path)
    longer = RunOutputs(build_config({"output_dir": str(tmp_path / "run")}, ["rounds=80", "client.lr=1.0"]))
    assert _resume(longer)["round"] == 1
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rounds"] == 80 and saved["client"]["lr"] == 1.0


@pytest.mark.parametrize("make", [lambda d: None, lambda d: d.mkdir()], ids=["no folder", "no checkpoint"])
def test_resume_without_a_checkpoint_is_refused_and_creates_nothing(tmp_path, make):
    make(tmp_path / "run")
    existed = (tmp_path / "run").exists()
    with pytest.raises(ResumeError, match=f"nothing to resume in {tmp_path / 'run'}"):
        _resume(RunOutputs(build_config({"output_dir": str(tmp_path / "run")})))
    assert (tmp_path / "run").exists() == existed


def test_a_corrupt_checkpoint_is_named(tmp_path):
    out = _checkpointed(tmp_path)
    path = out.dir / CHECKPOINT
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(ResumeError, match=f"{path} is not a readable checkpoint"):
        _resume(RunOutputs(out.cfg))


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _torch_write_failed(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")


@pytest.mark.parametrize("where, failure, write, name", [
    ("torch.save", _no_space, lambda out: _save(out, 1), "checkpoint.pt"),
    ("torch.save", _torch_write_failed, lambda out: out.save_model("final_model.pt", {}), "final_model.pt"),
    ("pathlib.Path.write_text", _no_space, lambda out: out.write_json("summary.json", {}), "summary.json"),
    ("pandas.DataFrame.to_csv", _no_space, lambda out: out.log_round(_row(1)), "metrics.csv"),
], ids=["checkpoint", "model-torch-enforce-fail", "summary", "metrics"])
def test_a_failed_write_names_the_file_in_one_line(tmp_path, monkeypatch, where, failure, write, name):
    out = _outputs(tmp_path)
    monkeypatch.setattr(where, failure)
    with pytest.raises(OSError) as err:
        write(out)
    assert err.value.filename == str(out.dir / name)
    line = describe_os_error(err.value)
    assert str(out.dir / name) in line and "\n" not in line
    if failure is _no_space:
        assert "No space left on device" in line and "--resume" in line
    assert not list(out.dir.glob("*.tmp"))  # what a failed save wrote is removed


def test_a_failed_checkpoint_write_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    out = _checkpointed(tmp_path)
    before = (out.dir / CHECKPOINT).read_bytes()

    def partly_written(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"half a checkpoint")
        _no_space()

    monkeypatch.setattr("torch.save", partly_written)
    with pytest.raises(OSError, match="No space left"):
        _save(out, 2)
    assert (out.dir / CHECKPOINT).read_bytes() == before and not list(out.dir.glob("*.tmp"))


@contextmanager
def _held_by_another_process(folder: Path):
    """A subprocess holding ``folder``'s run lock until the block ends; yields its pid."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom fedprivacy.outputs import run_lock\n"
                               f"with run_lock({str(folder)!r}):\n print('held', flush=True)\n"
                               " sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.communicate("")


def test_deleting_the_lock_file_does_not_release_the_folder(tmp_path):
    """Hardening II, finding 6: deleting .lock let a second --resume write into the same release log."""
    with _held_by_another_process(tmp_path / "run"):
        (tmp_path / "run" / ".lock").unlink()
        with pytest.raises(FolderBusyError, match="is running on"):
            with run_lock(tmp_path / "run"):
                pass
    with run_lock(tmp_path / "run"):  # released with its holder
        assert (tmp_path / "run" / ".lock").read_text().startswith(f"pid {os.getpid()}")


def test_a_second_run_into_a_held_folder_is_refused_naming_the_holder(tmp_path):
    with _held_by_another_process(tmp_path / "run") as pid:
        with pytest.raises(FolderBusyError, match=rf"pid {pid}, host {socket.gethostname()}, started 20"):
            run(build_config({"output_dir": str(tmp_path / "run")}))


# -- hardening III: which metrics.csv columns the reported epsilon covers ----------------------------------------
@pytest.mark.slow
def test_every_metrics_column_is_classified_and_the_raw_update_diagnostics_are_not_private(small_config, tmp_path):
    import json

    central = small_config("rounds=2", f"output_dir={tmp_path / 'central'}", "privacy.adaptive_clipping={}",
                           "privacy.noise_multiplier=0.3", "server.optimizer=adambc")
    distributed = small_config("rounds=1", f"output_dir={tmp_path / 'distributed'}",
                               "privacy.placement=distributed")
    for cfg in (central, distributed):
        run(cfg)
        header = list(pd.read_csv(cfg.output_dir / "metrics.csv").columns)
        columns = json.loads((cfg.output_dir / "metrics_columns.json").read_text())["columns"]
        assert list(columns) == header
        assert not [c for c, v in columns.items() if v["meaning"].startswith("not classified")]
        assert columns["epsilon_rdp"]["private"] and not columns["train_loss"]["private"]
        assert columns["server_noise_std"]["private"] == (cfg.privacy.placement == "central")
    columns = json.loads((central.output_dir / "metrics_columns.json").read_text())["columns"]
    for raw in ("clipped_fraction", "update_norm_median", "clipped_mean_norm"):
        assert columns[raw]["private"] is False and "raw updates" in columns[raw]["meaning"]
    assert columns["unclipped_fraction_released"]["private"] and columns["adambc_floored_fraction"]["private"]
    header = list(pd.read_csv(distributed.output_dir / "metrics.csv").columns)
    assert not {"clipped_fraction", "update_norm_median", "clipped_mean_norm"} & set(header)  # never seen there


def test_a_column_nobody_classified_is_not_private():
    from fedprivacy.outputs import metrics_columns

    got = metrics_columns(["epsilon_pld", "rejected_dtype", "test_recall_at_5", "new_diagnostic"], "central")
    assert [v["private"] for v in got.values()] == [True, False, False, False]


def test_the_secure_aggregation_columns_are_classified_as_not_private():
    from fedprivacy.fl.secure_aggregation import STAGES
    from fedprivacy.outputs import metrics_columns

    columns = ["secagg_aborted", "secagg_survivors", "secagg_integrity_refused",
               *(f"secagg_failed_{stage.replace('-', '_')}" for stage in STAGES)]
    got = metrics_columns(columns, "distributed")
    assert all(not v["private"] and not v["meaning"].startswith("not classified") for v in got.values()), got


def test_a_stream_that_does_not_describe_itself_is_named_with_no_strategy():
    from fedprivacy.outputs import noise_mechanism
    from fedprivacy.privacy.noise import GaussianNoise

    settings = dict(noise_multiplier=1.0, clip_norm=2.0, sampling="poisson", groups=1, placement="central")
    assert noise_mechanism("m:custom", object(), **settings)["strategy"] is None
    assert noise_mechanism("m:g", GaussianNoise(0), **settings)["strategy"]["kind"] == "independent"
