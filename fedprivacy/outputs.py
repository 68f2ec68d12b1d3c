"""A run's folder: resolved config, per-round metrics CSV, model weights, checkpoint, plot.

Layout of ``output_dir``::

    config.yaml         the resolved RunConfig
    metrics.csv         one row per round (round, train_loss, test_loss, test_accuracy,
                        epsilon_<accountant>..., cohort stats, seconds)
    initial_model.pt    state dict before round 1
    final_model.pt      state dict after the last round
    checkpoint.pt       everything needed to resume: the strategy's state file (:mod:`fedprivacy.fl.strategy_state`)
    releases.jsonl      the write-ahead release log (:mod:`fedprivacy.privacy.release_log`)
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
import json
import math
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml

from fedprivacy.checkpoints import STATE_FILE, ResumeError, atomic_save, writing
from fedprivacy.config import RunConfig
from fedprivacy.locks import LOCK_FILE, FolderBusyError, locked

CHECKPOINT = STATE_FILE
FIXED_ON_RESUME = ("seed", "privacy.", "data.task", "data.vocab_size", "data.num_tags")
"""Config fields (``.``: every field under the section) a resumed run cannot change: the privacy
claim and its randomness, and what determines the model's shape (task, vocabulary, tags); with the strategy's
settings, the one list a resume checks (:func:`fixed_settings`)."""


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


def run_lock(output_dir: str | Path, blocking: bool = False) -> AbstractContextManager[None]:
    """Hold ``output_dir``'s run lock (one run writes a folder at a time; re-entrant in a process); another
    process is refused with :class:`~fedprivacy.locks.FolderBusyError` naming the holder (or waits, ``blocking``)."""
    return locked(Path(output_dir) / LOCK_FILE, blocking, FolderBusyError, "`fedprivacy run`", reentrant=True)


def require_checkpoint(output_dir: str | Path) -> None:
    """Raises ResumeError ("nothing to resume in DIR") when ``output_dir`` holds no checkpoint."""
    if not (Path(output_dir) / CHECKPOINT).is_file():
        raise ResumeError(f"nothing to resume in {output_dir} (no {CHECKPOINT}); run without --resume to start it")


def fixed_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of a run's config (``RunConfig.to_json()``, parsed) that a resume may not change: every
    :data:`FIXED_ON_RESUME` field, as ``config.<dotted field>`` (the strategy's own settings, which the config also
    determines, are compared beside them: :meth:`fedprivacy.fl.strategy.DPFedAvg.fixed_settings`)."""
    flat: dict[str, Any] = {}

    def walk(tree: Any, prefix: str) -> None:
        if isinstance(tree, dict) and tree:
            for key, value in tree.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix.rstrip(".")] = tree

    walk(config, "")
    return {f"config.{k}": v for k, v in flat.items() if k.startswith(FIXED_ON_RESUME)}


class RunOutputs:
    """Writes a run's files (its checkpoint is the strategy's: :mod:`fedprivacy.fl.strategy_state`)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.output_dir)
        self.rows: list[dict[str, float]] = []
        self._columns: list[str] | None = None  # metrics.csv's header as last written

    def check(self, resume: bool) -> None:
        """Refuse to start a run over one the folder holds, or to resume none (nothing is written).

        Raises:
            RunExistsError: the folder holds a checkpoint and ``resume`` is false.
            ResumeError: ``resume`` and no checkpoint.
        """
        if resume:
            require_checkpoint(self.dir)
        elif (self.dir / CHECKPOINT).exists():
            raise RunExistsError(f"{self.dir} already holds a run ({CHECKPOINT}); pass --resume to continue it "
                                 "or choose another output_dir")

    def prepare(self, resume: bool) -> None:
        """:meth:`check`, then create the folder and write config.yaml (a resume's allowed changes included)."""
        self.check(resume)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_text("config.yaml", yaml.safe_dump(json.loads(self.cfg.to_json()), sort_keys=False))

    def restore(self, rows: list[dict[str, float]]) -> None:
        """The checkpointed rows, as ``metrics.csv`` (rows of rounds run after the checkpoint are dropped)."""
        self.rows = list(rows)
        self._write_metrics()

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

    def write_json(self, name: str, data: Any) -> None:
        """``name`` in the run folder, as indented STRICT JSON (:func:`strict_json`)."""
        self._write_text(name, json.dumps(strict_json(data), indent=2, default=str, allow_nan=False))

    def finish(self, summary: dict[str, Any]) -> None:
        self.write_json("summary.json", summary)
        if self.rows:
            with writing(self.dir / "metrics.png"):
                plot_metrics(pd.DataFrame(self.rows), self.dir / "metrics.png", summary.get("majority_baseline_accuracy"))


def plot_metrics(df: pd.DataFrame, path: Path, baseline: float | None = None) -> None:
    """Test accuracy (with the majority-tag baseline) and epsilon (every accountant) against the round, each at the
    rounds that report it (``fedprivacy run`` reports the accountants other than the budget's at the evaluated ones)."""
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
        reported = df.dropna(subset=[col])
        if len(reported):
            ax_eps.plot(reported["round"], reported[col], label=col.removeprefix("epsilon_"))
    ax_eps.set(xlabel="round", ylabel="epsilon", title="Privacy spent")
    ax_eps.legend()
    for ax in (ax_acc, ax_eps):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
