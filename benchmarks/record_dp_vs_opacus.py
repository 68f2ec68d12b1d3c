"""Seconds per record-level DP-SGD step: fedprivacy's client step vs Opacus's own ``make_private`` loop.

One step, both sides: Poisson-sample a batch (expected ``--batch`` records, Opacus's ``DPDataLoader``),
per-record gradients, flat L2 clip of each to C, sum, add N(0, sigma^2 C^2) on every coordinate,
divide by the expected batch, SGD step (Abadi et al. 2016, arXiv:1607.00133v2, Alg. 1). The same
records, batch, model weights, sigma = 1, C = 1, lr 0.1, one torch thread.

* ``tag``: the full-size StackOverflow tag model (softmax regression 10,000 -> 500, 5,000,500
  parameters) on synthetic tag records. fedprivacy: :func:`~fedprivacy.client.sample_dp.train_sample_dp_softmax`
  (closed-form clipped sum on the CSR rows). Opacus cannot take CSR rows, and its ``EmbeddingBag``
  grad sampler ignores ``per_sample_weights``, so its side is the same function as ``nn.Linear``
  on the dense rows, in both of Opacus's modes: ``hooks`` (per-sample gradients materialised) and
  ``ghost`` (fast gradient clipping, two backward passes); the faster is the reference.
  fedprivacy's time per step is a whole client round of ``--steps`` steps over ``--steps`` (its one-off
  costs, the start copy, the accountant and the epsilon, included: an upper bound on a step).
* ``next_word``: TFF's LSTM (``NextWordLSTM``, 4,053,428 parameters) with its ``nn.LSTM`` replaced
  by Opacus's ``DPLSTM`` (``ModuleValidator.fix``: Opacus computes no per-sample gradients of
  ``nn.LSTM``, for fedprivacy as for Opacus), per-record loss = mean cross-entropy over the record's
  non-pad targets. fedprivacy: :func:`~fedprivacy.client.sample_dp.run_sample_dp` (what
  ``train_sample_dp`` runs), timed per step through its ``on_step`` callback.

Opacus's steps are timed around each iteration of its loop (data loading included, as on our side).
Its Poisson loader (Opacus's ``DPDataLoader``, passed to ``make_private`` with ``poisson_sampling=False``
as it is Poisson already) draws from fedprivacy's sampling stream, so both sides step on the same batches.
Each side runs ``--repeat`` times, interleaved; the first ``--warmup`` steps of each run are dropped.
Goal: fedprivacy's median <= 1.25x Opacus's (the faster mode for ``tag``); exit status 1 if missed.

    python benchmarks/record_dp_vs_opacus.py [--models tag next_word] [--steps 30] [--repeat 3] [--batch 16]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn
from torch.utils.data import TensorDataset

GOAL = 1.25
SIGMA, CLIP, LR = 1.0, 1.0, 0.1
SEED = 0  # fedprivacy's client seed; Opacus's loader samples from the same stream (the same batches)


def _summary(seconds: list[float]) -> dict:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds), "n": len(seconds)}


def opacus_steps(model: nn.Module, dataset: TensorDataset, batch: int, steps: int, warmup: int, mode: str,
                 per_record_loss) -> list[float]:
    """Seconds of each step of Opacus's own DP-SGD loop (``PrivacyEngine.make_private``, Poisson batches)."""
    from opacus import PrivacyEngine
    from opacus.data_loader import DPDataLoader

    from fedprivacy.privacy.noise import torch_seed

    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    # Opacus's Poisson loader, on fedprivacy's sampling stream of seed 0: both sides see the same batches
    loader = DPDataLoader(dataset, sample_rate=batch / len(dataset),
                          generator=torch.Generator().manual_seed(torch_seed(np.random.SeedSequence(SEED).spawn(4)[1])))
    engine = PrivacyEngine(accountant="rdp")

    def criterion(out, y):
        return per_record_loss(out, y).mean()

    kwargs = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                  poisson_sampling=False, grad_sample_mode=mode)  # the loader above is Poisson already
    if mode == "ghost":
        model, optimizer, criterion, loader = engine.make_private(criterion=criterion, **kwargs)
    else:
        model, optimizer, loader = engine.make_private(**kwargs)
    seconds, t0 = [], time.perf_counter()
    while len(seconds) < warmup + steps:
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            optimizer.step()
            seconds.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            if len(seconds) == warmup + steps:
                break
    return seconds[warmup:]


def _tag_setup(n: int, data: Path):
    """``n`` synthetic tag records (CSR), their labels, and the full-size model with small random weights."""
    from fedprivacy.config import build_config
    from fedprivacy.stackoverflow_tasks import ensure_data, load_task

    cfg = build_config({"data": {"path": str(data)}, "output_dir": "unused"})
    ensure_data(cfg.data)
    task = load_task(cfg.data)
    parts, labels, have, client = [], [], 0, 0
    while have < n:
        f, y = task.client_data(client)
        parts.append(f)
        labels.append(np.asarray(y))
        have, client = have + f.shape[0], client + 1
    features = sp.vstack(parts).tocsr()[:n]
    model = task.new_model()
    torch.manual_seed(0)
    nn.init.normal_(model.embedding.weight, std=0.01)
    return features, np.concatenate(labels)[:n].astype(np.int64), model


def bench_tag(args) -> dict:
    from fedprivacy.client.sample_dp import train_sample_dp_softmax
    from fedprivacy.optim.sample_dp import SampleDPConfig

    n = args.records
    features, labels, model = _tag_setup(n, args.data)
    cfg = SampleDPConfig(lr=LR, noise_multiplier=SIGMA, clip_norm=CLIP, batch_size=args.batch)
    q = args.batch / n
    dense = nn.Linear(features.shape[1], model.bias.numel())
    with torch.no_grad():
        dense.weight.copy_(model.embedding.weight.T)
        dense.bias.copy_(model.bias)
    dataset = TensorDataset(torch.from_numpy(features.toarray()), torch.from_numpy(labels))

    def ce(out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")

    def ours_round(steps: int) -> float:
        t0 = time.perf_counter()
        r = train_sample_dp_softmax(model, features, labels, cfg, SEED, epochs=steps * q)
        assert r.steps == steps, (r.steps, steps)
        return (time.perf_counter() - t0) / steps

    ours, hooks, ghost = [], [], []
    ours_round(2)  # warm-up
    for _ in range(args.repeat):
        ours.append(ours_round(args.steps))
        hooks += opacus_steps(dense, dataset, args.batch, args.hooks_steps, args.warmup, "hooks", ce)
        ghost += opacus_steps(dense, dataset, args.batch, args.steps, args.warmup, "ghost", ce)
    result = {"params": sum(p.numel() for p in model.parameters()), "records": n, "expected_batch": args.batch,
              "fedprivacy_round_per_step": _summary(ours),
              "opacus_hooks_step": _summary(hooks), "opacus_ghost_step": _summary(ghost)}
    best = min(result["opacus_hooks_step"]["median_s"], result["opacus_ghost_step"]["median_s"])
    result["fedprivacy_over_opacus"] = result["fedprivacy_round_per_step"]["median_s"] / best
    return result


def bench_next_word(args) -> dict:
    from opacus.validators import ModuleValidator

    from fedprivacy.client.sample_dp import run_sample_dp
    from fedprivacy.config import build_config
    from fedprivacy.models.lstm import NextWordLSTM
    from fedprivacy.optim.sample_dp import SampleDPConfig
    from fedprivacy.stackoverflow_tasks import ensure_data, load_task

    dcfg = build_config({"data": {"path": str(args.data), "task": "next_word"}, "output_dir": "unused"})
    ensure_data(dcfg.data)
    task = load_task(dcfg.data)
    rows = torch.from_numpy(np.asarray(task.train.tokens[:args.records], dtype=np.int64))
    dataset = TensorDataset(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
    torch.manual_seed(0)
    model = ModuleValidator.fix(NextWordLSTM(int(task.train.vocab_size) + 4))
    cfg = SampleDPConfig(lr=LR, noise_multiplier=SIGMA, clip_norm=CLIP, batch_size=args.batch)

    def per_record(out, y):  # mean cross-entropy over the record's non-pad targets
        losses = nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=0, reduction="none")
        return losses.view(y.shape).sum(1) / (y != 0).sum(1).clamp_min(1)

    def ours_steps(steps: int) -> list[float]:
        working = copy.deepcopy(model)
        stamps = [time.perf_counter()]
        run_sample_dp(working, dataset, cfg, SEED, steps=args.warmup + steps, loss_fn=per_record,
                      on_step=lambda t, opt: stamps.append(time.perf_counter()))
        return np.diff(stamps).tolist()[args.warmup:]

    ours, hooks = [], []
    for _ in range(args.repeat):
        ours += ours_steps(args.lstm_steps)
        hooks += opacus_steps(model, dataset, args.batch, args.lstm_steps, args.warmup, "hooks", per_record)
    result = {"params": sum(p.numel() for p in model.parameters()), "records": len(dataset),
              "expected_batch": args.batch, "fedprivacy_step": _summary(ours), "opacus_hooks_step": _summary(hooks)}
    result["fedprivacy_over_opacus"] = result["fedprivacy_step"]["median_s"] / result["opacus_hooks_step"]["median_s"]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tag", "next_word"], choices=["tag", "next_word"])
    ap.add_argument("--data", type=Path, default=Path("data/synthetic"))
    ap.add_argument("--records", type=int, default=1600, help="records the batches are sampled from")
    ap.add_argument("--batch", type=int, default=16, help="expected records per step (client.sample_dp.batch_size)")
    ap.add_argument("--steps", type=int, default=30, help="tag: timed steps per run (fedprivacy: one round of them)")
    ap.add_argument("--hooks-steps", type=int, default=5, help="tag: timed steps per run of Opacus's hooks mode")
    ap.add_argument("--lstm-steps", type=int, default=3, help="next_word: timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of each run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the report (JSON) here")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    results = {}
    for name in args.models:
        results[name] = (bench_tag if name == "tag" else bench_next_word)(args)
        print(json.dumps({name: results[name]}), flush=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other agents)",
              "torch": torch.__version__, "opacus": __import__("opacus").__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "load_before": load_before, "load_after": os.getloadavg(), "results": results,
              "goals": {k: {"met": r["fedprivacy_over_opacus"] <= GOAL, "target": GOAL} for k, r in results.items()}}
    print(json.dumps(report, indent=2))
    for name, r in results.items():
        print(f"{name:10s} fedprivacy / Opacus per step {r['fedprivacy_over_opacus']:6.2f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    missed = [k for k, g in report["goals"].items() if not g["met"]]
    if missed:
        print(f"goals missed: {', '.join(missed)}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
