"""Evaluation of a finished run's final model on held-out users, for hyperparameter selection.

TFF's StackOverflow (and the synthetic data, :mod:`fedprivacy.data.synthetic`) has three splits:
``train`` (the federation's users), ``heldout`` (users who never train) and ``test``. Selecting a
grid point on the test metric biases the reported test metric upwards (the max over grid points
of noisy estimates); selecting on users disjoint from both the training and the test users does
not. :func:`heldout_metrics` evaluates a run's ``final_model.pt`` with the task's own ``evaluate``
(example-weighted: total correct / total examples) on the first ``clients`` held-out users (all
users when None), and names each metric ``heldout_<name>`` (``test_accuracy`` ->
``heldout_accuracy``). The result is cached beside the model in ``heldout.json`` (keyed by the
number of users and the model file's identity), so a report recomputes nothing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fedprivacy.config import ConfigError, RunConfig
from fedprivacy.data.prepared import prepared_tags, prepared_tokens
from fedprivacy.data.sources import file_identity, open_source
from fedprivacy.experiments.study import heldout_name
from fedprivacy.stackoverflow_tasks import BUILTIN_TASKS, cache_root, load_task

HELDOUT_FILE = "heldout.json"
FINAL_MODEL = "final_model.pt"


def _heldout_task(cfg: RunConfig, clients: int | None):
    """The run's task with its evaluation set replaced by the held-out users' examples."""
    data = cfg.data
    if data.task not in BUILTIN_TASKS:
        raise ConfigError(f"selection.split=heldout: data.task {data.task!r} is a user's task; held-out users "
                          "exist only for the built-in StackOverflow tasks")
    task = load_task(data)
    if data.source == "synthetic":  # the held-out users, generated on demand
        if clients is None:
            raise ConfigError("selection.heldout_clients must be set with data.source=synthetic (all held-out "
                              "users of a large on-demand population do not fit in memory)")
        held = task.train.split("heldout", first_users=clients)
    else:
        source, root = open_source(data.source, data.path), cache_root(data)
        if data.task == "next_word":
            tokens, _ = prepared_tokens(source, "heldout", vocab_size=data.vocab_size, seq_len=data.seq_len,
                                        first=clients, cache_root=root)
            return dataclasses.replace(task, test_tokens=tokens.tokens)
        held, _ = prepared_tags(source, "heldout", vocab_size=data.vocab_size, num_tags=data.num_tags,
                                no_tag=data.no_tag, first=clients, cache_root=root)
    labels = held.tags if data.task == "tag_multilabel" else held.labels
    return dataclasses.replace(task, test_features=held.features, test_labels=labels)


def heldout_metrics(run_dir: str | Path, cfg: RunConfig, clients: int | None = None) -> dict[str, float]:
    """``heldout_<metric>`` of the run's final model on the first ``clients`` held-out users (cached).

    Raises:
        FileNotFoundError: the run has no ``final_model.pt`` (it has not finished).
        ConfigError: the run's task has no held-out split (a user's task).
    """
    import torch

    run_dir = Path(run_dir)
    model_path = run_dir / FINAL_MODEL
    if not model_path.exists():
        raise FileNotFoundError(f"{model_path}: no final model to evaluate on held-out users")
    key = {"clients": clients, "model": file_identity(model_path)}
    cache = run_dir / HELDOUT_FILE
    if cache.exists():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return stored["metrics"]
    task = _heldout_task(cfg, clients)
    model = task.new_model()
    model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    metrics = {heldout_name(k): float(v) for k, v in task.evaluate(model).items()}
    cache.write_text(json.dumps({"key": key, "metrics": metrics}))
    return metrics
