"""A run's folder: resolved config, per-round metrics CSV, model weights, checkpoint, plot.

Layout of ``output_dir``::

    config.yaml         the resolved RunConfig
    metrics.csv         one row per round (round, train_loss, test_loss, test_accuracy,
                        epsilon_<accountant>..., cohort stats, seconds)
    initial_model.pt    state dict before round 1
    final_model.pt      state dict after the last round
    checkpoint.pt       everything needed to resume (written atomically)
    .lock               held by the run while it runs (:func:`run_lock`)
    metrics.png         test accuracy and epsilon vs round
    metrics_columns.json  each metrics.csv column: whether it is private (derived only from released values
                        and public settings, covered by the reported epsilon) and what it is
    noise_mechanism.json  the server's noise stream: its parameters and coefficients (:func:`noise_mechanism`)
    summary.json        final numbers and why the run stopped
    side_information.json   AdaDPS only: provenance of each public A the clients received
"""

from __future__ import annotations

import csv
import errno
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml

from fedprivacy.config import RunConfig, config_differences
from fedprivacy.locks import FolderBusyError, locked

RoundCallback = Callable[[int, Mapping[str, float]], None]
"""Called with ``(round, metrics)`` once a round is recorded: a ``metrics.csv`` row (``fedprivacy run``) or the
round's strategy metrics (:class:`~fedprivacy.fl.strategy.DPFedAvg`'s ``on_round``)."""

CHECKPOINT = "checkpoint.pt"
RUN_LOCK = ".lock"
FIXED_ON_RESUME = ("seed", "privacy.", "data.task", "data.vocab_size", "data.num_tags")
"""Config fields (``.``: every field under the section) a resumed run cannot change: the privacy
claim and its randomness, and what determines the model's shape (task, vocabulary, tags)."""


_WHO_REPLIED = "who replied and how, counted without noise"
METRICS_COLUMNS: dict[str, tuple[bool, str]] = {
    "round": (True, "the round number"),
    "epsilon_": (True, "epsilon so far under this accountant, from the ledger of the run's settings"),
    "clip_norm": (True, "C_t: fixed, or moved by the released noisy unclipped count (adaptive clipping)"),
    "unclipped_fraction_released": (True, "adaptive clipping's released (noised) unclipped fraction"),
    "adambc_floored_fraction": (True, "DP-FedAdamBC's state, computed from the released averages"),
    "downlink_bytes_per_client": (True, "the size of what the server sends, from released values"),
    "server_noise_std": (True, "the std of the server's draw, from z and C_t"),
    "train_loss": (False, "the mean of the losses the accepted clients report on their own data, noise-free"),
    "test_": (False, "the released model evaluated on the evaluation data, which epsilon does not cover"),
    "clipped_fraction": (False, "noise-free: the fraction of raw updates above C_t, computed by the server from "
                                "the clients' raw updates (central placement only)"),
    "update_norm_median": (False, "noise-free: the median L2 norm of the clients' raw updates, computed by the "
                                  "server (central placement only)"),
    "clipped_mean_norm": (False, "noise-free: the L2 norm of the mean of the clipped raw updates before the noise "
                                 "(the signal; central placement only)"),
    "client_epsilon_max": (False, "the largest client epsilon, from the clients' reported record-level events "
                                  "(their own data sizes)"),
    "cohort_sampled": (False, "the size of the sampled cohort, which the privacy analysis keeps hidden"),
    "cohort_received": (False, _WHO_REPLIED), "cohort_accepted": (False, _WHO_REPLIED),
    "cohort_dropped": (False, _WHO_REPLIED), "rejected_": (False, _WHO_REPLIED),
    "secagg_survivors": (False, _WHO_REPLIED), "secagg_aborted": (False, _WHO_REPLIED),
    "secagg_failed_": (False, _WHO_REPLIED),
    "secagg_integrity_refused": (False, "whether the server refused the round's decoded sum as larger than honest "
                                        "clients can make it (a tampered upload)"),
    "uplink_bytes_per_client": (False, "the mean size of the accepted replies (a sparse upload's depends on its data)"),
    "residual_bytes_per_client": (False, "the clients' reported error-feedback residual size"),
    "side_information_bytes": (False, "AdaDPS bytes sent to this cohort (which sampled nodes had A already)"),
    "seconds": (False, "the round's wall time, which the clients' work sets"),
}
"""Each ``metrics.csv`` column (a name ending in ``_``: every column it starts) -> (private, what it is). Private:
derived only from released (noised) values and public settings, so covered by the reported epsilon; otherwise
a diagnostic of the simulation that epsilon does NOT cover (never publish it as private)."""


def metrics_columns(columns: list[str], placement: str) -> dict[str, dict[str, Any]]:
    """``metrics_columns.json``: each of ``columns`` with ``private`` and ``meaning`` (:data:`METRICS_COLUMNS`); an
    unknown column, and ``server_noise_std`` outside central placement (a top-up for the missing shares: it
    counts who replied), are not private."""
    out = {}
    for column in columns:
        key = column if column in METRICS_COLUMNS else next(
            (k for k in METRICS_COLUMNS if k.endswith("_") and column.startswith(k)), None)
        private, meaning = METRICS_COLUMNS[key] if key else (False, "not classified: treat it as not private")
        if column == "server_noise_std" and placement != "central":
            private, meaning = False, "the std of the server's top-up for the missing shares: it counts who replied"
        out[column] = {"private": private, "meaning": meaning}
    return out


def noise_mechanism(name: str, stream: Any, *, noise_multiplier: float, clip_norm: float, sampling: str,
                    groups: int, placement: str) -> dict[str, Any]:
    """``noise_mechanism.json``: the server's noise stream (``name``, as the settings name it), the run's z, C and
    schedule, and the stream's strategy (its ``describe_strategy()``: kind, coefficients, sensitivity ``s(C)``
    under the schedule; None for a stream that does not describe itself), so that a reader rebuilds ``C`` and
    checks the noise without the Python API (:mod:`fedprivacy.privacy.matrix_factorization`)."""
    describe = getattr(stream, "describe_strategy", None)
    return {"noise_stream": name, "noise_multiplier": noise_multiplier, "clip_norm": clip_norm, "sampling": sampling,
            "groups": groups, "placement": placement,
            "release_noise": "central placement: release t adds z C s(C) (C^-1 w)_t with w ~ N(0, I) per coordinate "
                             "(the tree: s(C) times the difference of the efficient prefix estimates P_t - P_(t-1) of "
                             "its nodes; independent noise: C = I, s(C) = 1); the strategy restarts every horizon "
                             "releases",
            "strategy": describe() if callable(describe) else None}


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float made valid JSON: NaN (no value: a metric not measured
    this round) as ``null``, +-inf (e.g. the epsilon of a run without noise) as ``"inf"``/``"-inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class RunExistsError(RuntimeError):
    """The output folder already holds a run and resuming was not asked for."""


class ResumeError(ValueError):
    """``--resume`` cannot continue this folder: no checkpoint, an unreadable one, or a changed fixed field."""


def run_lock(output_dir: str | Path, blocking: bool = False) -> AbstractContextManager[None]:
    """Hold ``output_dir``'s run lock (one run writes a folder at a time; re-entrant in a process); another
    process is refused with :class:`~fedprivacy.locks.FolderBusyError` naming the holder (or waits, ``blocking``)."""
    return locked(Path(output_dir) / RUN_LOCK, blocking, FolderBusyError, "`fedprivacy run`", reentrant=True)


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """File-system errors while writing ``path`` name it (a write's ``OSError``, e.g. a full disk, names
    no file; torch reports a failed write as a RuntimeError, ``enforce fail at inline_container.cc``)."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror or str(err), str(path)) from None
    except RuntimeError as err:
        if "inline_container" not in str(err):
            raise
        raise OSError(errno.EIO, f"write failed ({str(err).splitlines()[-1].strip()})", str(path)) from None


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file and a rename: ``path`` holds the old or the new
    version, never a torn one (a crash or a full disk mid-write leaves the old)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(path):
        try:
            torch.save(obj, tmp)
        except BaseException:  # a full disk: free what was written; ``path`` keeps its last complete version
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, path)


def load_checkpoint(path: Path, **options: Any) -> dict:
    """A run's checkpoint (``options``: more arguments of ``torch.load``, e.g. ``mmap=True``).

    Raises:
        ResumeError: the file is not a readable checkpoint (corrupt or truncated), naming it.
    """
    try:
        return torch.load(path, weights_only=False, **options)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - torch and pickle raise many kinds on a damaged file
        raise ResumeError(f"{path} is not a readable checkpoint (corrupt or truncated: {type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}); move it away to start the run over") \
            from None


def require_checkpoint(output_dir: str | Path) -> None:
    """Raises ResumeError ("nothing to resume in DIR") when ``output_dir`` holds no checkpoint."""
    if not (Path(output_dir) / CHECKPOINT).is_file():
        raise ResumeError(f"nothing to resume in {output_dir} (no {CHECKPOINT}); run without --resume to start it")


def check_resumable(saved: str, cfg: RunConfig) -> None:
    """Refuse to resume under ``cfg`` a run checkpointed with config ``saved`` (its ``to_json()``) if a
    :data:`FIXED_ON_RESUME` field changed.

    Raises:
        ResumeError: naming every changed fixed field, old and new value.
    """
    changed = config_differences(json.loads(saved), json.loads(cfg.to_json()))
    fixed = {k: v for k, v in changed.items() if k.startswith(FIXED_ON_RESUME)}
    if fixed:
        raise ResumeError("--resume cannot change " + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in fixed.items())
                          + " (the run was started with the old values; restore them or use another output_dir)")


class RunOutputs:
    """Writes a run's files; reads its checkpoint back when resuming."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.output_dir)
        self.rows: list[dict[str, float]] = []
        self._columns: list[str] | None = None  # metrics.csv's header as last written

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / CHECKPOINT

    def prepare(self, resume: bool) -> dict | None:
        """Create the folder and write config.yaml; return the checkpoint to resume from (``None``: a fresh run).

        Raises:
            RunExistsError: the folder holds a checkpoint and ``resume`` is false.
            ResumeError: ``resume`` and no checkpoint, an unreadable one, or one saved under a config
                whose :data:`FIXED_ON_RESUME` fields differ from this run's.
        """
        if resume:
            require_checkpoint(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        state = None
        if self.checkpoint_path.exists():
            if not resume:
                raise RunExistsError(
                    f"{self.dir} already holds a run ({CHECKPOINT}); pass --resume to continue it "
                    "or choose another output_dir"
                )
            state = load_checkpoint(self.checkpoint_path)
            check_resumable(state["config"], self.cfg)
            self.rows = list(state["metrics"])
            self._write_metrics()
        self._write_text("config.yaml", yaml.safe_dump(json.loads(self.cfg.to_json()), sort_keys=False))
        return state

    def log_round(self, row: dict[str, float]) -> None:
        """Add a round's row to ``metrics.csv``: appended as one line when it has the file's columns
        (rewriting every row each round cost O(rounds) per round: 29 ms at round 1,000), else the
        whole file is rewritten with the new columns."""
        self.rows.append(row)
        if list(row) != self._columns:
            self._write_metrics()
            return
        with writing(self.dir / "metrics.csv"), open(self.dir / "metrics.csv", "a", newline="") as f:
            csv.writer(f).writerow("" if isinstance(v, float) and math.isnan(v) else v for v in row.values())

    def _write_metrics(self) -> None:
        frame = pd.DataFrame(self.rows)
        with writing(self.dir / "metrics.csv"):
            frame.to_csv(self.dir / "metrics.csv", index=False)
        self._columns = list(frame.columns)
        self.write_json("metrics_columns.json", {
            "private": "derived only from released (noised) values and public settings: covered by the reported "
                       "epsilon; false: a diagnostic that epsilon does not cover (do not publish it as private)",
            "columns": metrics_columns(self._columns, self.cfg.privacy.placement)})

    def _write_text(self, name: str, text: str) -> None:
        with writing(self.dir / name):
            (self.dir / name).write_text(text)

    def save_model(self, name: str, state_dict: dict[str, torch.Tensor]) -> None:
        atomic_save({k: v.detach().cpu() for k, v in state_dict.items()}, self.dir / name)

    def save_checkpoint(self, state: dict) -> None:
        atomic_save({**state, "metrics": self.rows, "config": self.cfg.to_json()}, self.checkpoint_path)

    def write_json(self, name: str, data: Any) -> None:
        """``name`` in the run folder, as indented STRICT JSON (:func:`strict_json`)."""
        self._write_text(name, json.dumps(strict_json(data), indent=2, default=str, allow_nan=False))

    def finish(self, summary: dict[str, Any]) -> None:
        self.write_json("summary.json", summary)
        if self.rows:
            with writing(self.dir / "metrics.png"):
                plot_metrics(pd.DataFrame(self.rows), self.dir / "metrics.png", summary.get("majority_baseline_accuracy"))


def plot_metrics(df: pd.DataFrame, path: Path, baseline: float | None = None) -> None:
    """Test accuracy (with the majority-tag baseline) and epsilon (every accountant) against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_eps) = plt.subplots(1, 2, figsize=(10, 4))
    acc = df.dropna(subset=["test_accuracy"]) if "test_accuracy" in df else df.iloc[0:0]
    ax_acc.plot(acc["round"], acc.get("test_accuracy", []), marker="o")
    if baseline is not None:
        ax_acc.axhline(baseline, linestyle="--", color="gray", label="majority tag")
        ax_acc.legend()
    ax_acc.set(xlabel="round", ylabel="test accuracy", title="Test accuracy")
    for col in [c for c in df.columns if c.startswith("epsilon_")]:
        if df[col].notna().any():
            ax_eps.plot(df["round"], df[col], label=col.removeprefix("epsilon_"))
    ax_eps.set(xlabel="round", ylabel="epsilon", title="Privacy spent")
    ax_eps.legend()
    for ax in (ax_acc, ax_eps):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
