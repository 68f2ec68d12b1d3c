"""Optimizer-state memory of the client optimizers: DP-MicroAdam vs DP-Adam.

The paper (arXiv:2511.20509) states DP-MicroAdam is memory-frugal; its memory analysis derives
~0.9 d bytes for its Algorithm 1 layout (4-bit EF, int16 indices + bf16 values in the ring) against
8 d for Adam (two fp32 moments). This script MEASURES, for our implementations, in a fresh process
per optimizer (``--d`` parameters, one flat tensor, float32, CPU):

- ``state B/param``: bytes of the tensors the optimizer keeps between steps (exact: the sum of
  ``nbytes`` of its state tensors after ``--steps`` steps), divided by d;
- ``peak RSS growth B/param``: the process's peak resident memory (``ru_maxrss``) after the steps
  minus its resident memory before the optimizer was built (parameters and gradient already
  allocated), divided by d: persistent state plus the largest transient a step allocates.

Both sample-level wrappers (``fedprivacy.optim.sample_dp.make_base_optimizer``) are the ones the
clients use; DP noise and clipping add no optimizer state (they run before the base step).

    python benchmarks/optimizer_state_memory.py [--d 5000500] [--density 0.01] [--ring 10] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

import torch


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _state_bytes(optimizer) -> int:
    """Bytes of every tensor the optimizer keeps between steps."""
    from fedprivacy.optim.sample_dp import FlatDescent

    if isinstance(optimizer, FlatDescent):
        state = optimizer.inner.state_dict()
    else:
        state = optimizer.state_dict()["state"]
    total, stack = 0, [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def measure(base: str, d: int, density: float, ring: int, steps: int) -> dict:
    """One optimizer in THIS process (call through a subprocess for a clean peak)."""
    from fedprivacy.optim.sample_dp import SampleDPConfig, make_base_optimizer

    torch.set_num_threads(1)
    param = torch.nn.Parameter(torch.zeros(d))
    param.grad = torch.zeros(d)
    gen = torch.Generator().manual_seed(0)
    before_kb = _rss_kb()
    peak_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = SampleDPConfig(base=base, lr=1e-3, density=density, ring_size=ring, per_tensor_topk=False)
    optimizer = make_base_optimizer([param], cfg)
    t0 = time.perf_counter()
    for _ in range(steps):
        param.grad.normal_(generator=gen)  # in place: no new allocation
        optimizer.step()
    seconds = (time.perf_counter() - t0) / steps
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    growth = (peak_kb - max(before_kb, peak_before_kb)) * 1024
    return {"optimizer": base, "d": d, "state_bytes": _state_bytes(optimizer),
            "peak_rss_growth_bytes": max(growth, 0), "seconds_per_step": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=5_000_500, help="parameters (default: the tag model)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--ring", type=int, default=10)
    ap.add_argument("--steps", type=int, default=12, help="steps before measuring (> ring: the ring is full)")
    ap.add_argument("--child", choices=["adam", "microadam"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.d, args.density, args.ring, args.steps)))
        return 0
    rows = []
    for base in ("adam", "microadam"):
        out = subprocess.run([sys.executable, __file__, "--child", base, "--d", str(args.d), "--density",
                              str(args.density), "--ring", str(args.ring), "--steps", str(args.steps)],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    adam = next(r for r in rows if r["optimizer"] == "adam")
    print(f"d = {args.d:,}, density {args.density}, ring {args.ring}, {args.steps} steps; "
          f"{platform.machine()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print("| optimizer | state B/param | state MB | peak RSS growth B/param | state vs DP-Adam | s/step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| DP-{'Adam' if r['optimizer'] == 'adam' else 'MicroAdam'} | {r['state_bytes'] / args.d:.3f} | "
              f"{r['state_bytes'] / 1e6:.1f} | {r['peak_rss_growth_bytes'] / args.d:.2f} | "
              f"{r['state_bytes'] / adam['state_bytes']:.3f} | {r['seconds_per_step']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
