"""Correlated noise: per-release time and memory of each noise stream vs independent noise.

At ``--d`` float32 coordinates on the CPU (default 5,000,500, the tag task's model), for independent noise
(:class:`~fedprivacy.privacy.noise.GaussianNoise`), the tree (horizon 1024), BandMF (4 and 16 bands) and BLT
(3 and 5 buffers), horizon 1024, min separation 64:

- **seconds per release**: ``stream.add_(target, std)`` (the call the mechanism makes, no prefetch) timed over
  ``--releases`` releases after ``--warmup`` untimed ones; the streams are interleaved (each repetition runs
  every stream once, in an order rotated per repetition), ``--repeat`` repetitions. Per repetition the mean
  seconds per release over its releases (the tree's cost depends on the release: more draws when more
  subtrees complete), and its ratio to independent noise in the same repetition; reported: median [min, max]
  over repetitions. Streams keep their state across repetitions (release numbers keep increasing).
- **persistent memory**: the bytes of the stream's buffers between releases (``stream._buffers``; the largest
  seen after any release), in model-sized vectors (``4 d`` bytes) and MB. Exact.
- **peak RSS growth**: in a fresh process per stream, the process's peak resident memory (``VmHWM``) after
  ``--rss-releases`` releases minus its resident memory before the first one (target and stream built):
  persistent buffers plus the largest transient a release allocates. Twice: with glibc's default malloc (whose
  dynamic mmap threshold keeps freed model-sized blocks in the heap, so churn shows as RSS) and with
  ``MALLOC_MMAP_THRESHOLD_=1048576`` (every model-sized block is mmap-ed and unmapped when freed: the peak of
  live tensors).

Then the memory of BLT (3 buffers) and the tree at horizons 64 and 2048 (their buffers are all allocated at
the first release of a horizon, so one release shows them): BLT's does not depend on the horizon, the tree's
is ``floor(log2 n) + 1`` vectors.

    python benchmarks/correlated_noise_cost.py [--d 5000500] [--releases 30] [--warmup 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from machine import machine_line  # this folder (the script's) is on sys.path
from fedprivacy.privacy.bandmf import BandMFNoise
from fedprivacy.privacy.blt import BLTNoise
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.tree import TreeNoise

SEPARATION = 64


def build(name: str, seed: int = 0, horizon: int = 1024):
    if name == "independent":
        return GaussianNoise(seed)
    kind, _, size = name.partition(" ")
    if kind == "tree":
        return TreeNoise(seed, horizon=horizon, separation=SEPARATION)
    if kind == "bandmf":
        return BandMFNoise(seed, horizon=horizon, separation=SEPARATION, bands=int(size))
    if kind == "blt":
        return BLTNoise(seed, horizon=horizon, separation=SEPARATION, buffers=int(size))
    raise ValueError(name)


STREAMS = ["independent", "tree", "bandmf 4", "bandmf 16", "blt 3", "blt 5"]


def buffer_bytes(stream) -> int:
    return sum(b.element_size() * b.nelement() for b in getattr(stream, "_buffers", []))


def std_of(stream, release: int) -> float:
    return stream.std_factor(release)  # z C = 1


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _hwm_kb() -> int:
    """The process's peak resident set (``VmHWM``: per address space, so reset by ``exec``, unlike ``ru_maxrss``,
    which a child inherits from its parent's size at ``fork``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def child_rss(name: str, d: int, releases: int) -> None:
    """Fresh process: peak RSS growth over ``releases`` releases of one stream (printed as JSON)."""
    target = torch.zeros(d, dtype=torch.float32)
    stream = build(name)
    stream.std_factor(1)
    before = _rss_kb()
    assert _hwm_kb() - before < 4 * d // 1024, "the peak before the releases is above the baseline"
    for t in range(1, releases + 1):
        stream.add_(target, std_of(stream, t))
    peak = _hwm_kb()
    print(json.dumps({"peak_growth_kb": peak - before, "buffers": buffer_bytes(stream)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=5_000_500)
    parser.add_argument("--releases", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rss-releases", type=int, default=64)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_rss(args.child, args.d, args.rss_releases)
        return 0

    print(f"{machine_line()}; d = {args.d:,} float32; horizon 1024, min separation {SEPARATION}")
    vector_bytes = 4 * args.d
    target = torch.zeros(args.d, dtype=torch.float32)
    streams = {name: build(name) for name in STREAMS}
    count = {name: 0 for name in STREAMS}
    most = {name: 0 for name in STREAMS}

    def release(name: str) -> None:
        count[name] += 1
        streams[name].add_(target, std_of(streams[name], count[name]))
        most[name] = max(most[name], buffer_bytes(streams[name]))

    for name in STREAMS:
        for _ in range(args.warmup):
            release(name)
    per: dict[str, list[float]] = {name: [] for name in STREAMS}
    for rep in range(args.repeat):
        order = STREAMS[rep % len(STREAMS):] + STREAMS[:rep % len(STREAMS)]
        for name in order:
            t0 = time.perf_counter()
            for _ in range(args.releases):
                release(name)
            per[name].append((time.perf_counter() - t0) / args.releases)
        print(f"  repetition {rep + 1}: " + ", ".join(f"{n} {per[n][-1] * 1e3:.1f} ms" for n in STREAMS),
              flush=True)

    rss: dict[str, dict[str, dict]] = {"default": {}, "mmap": {}}
    for name in STREAMS:
        for allocator, extra in (("default", {}), ("mmap", {"MALLOC_MMAP_THRESHOLD_": "1048576"})):
            out = subprocess.run([sys.executable, __file__, "--child", name, "--d", str(args.d),
                                  "--rss-releases", str(args.rss_releases)], capture_output=True, text=True,
                                 check=True, env={**os.environ, **extra})
            rss[allocator][name] = json.loads(out.stdout.strip().splitlines()[-1])

    print(f"\n{args.releases} timed releases per repetition after {args.warmup} warm-up, {args.repeat} interleaved "
          f"repetitions; median [min, max] over repetitions\n")
    print("| stream | ms / release | / independent (same repetition) | persistent buffers | MB | "
          f"peak RSS growth, {args.rss_releases} releases: glibc default | same, freed blocks unmapped at once |")
    print("|---|---|---|---|---|---|---|")
    for name in STREAMS:
        ms = [x * 1e3 for x in per[name]]
        ratios = [a / b for a, b in zip(per[name], per["independent"])]
        label = name if name == "independent" else f"{name} (n=1024)"
        print(f"| {label} | {statistics.median(ms):.1f} [{min(ms):.1f}, {max(ms):.1f}] | "
              f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] | "
              f"{most[name] / vector_bytes:g} x d | {most[name] / 2 ** 20:.1f} | "
              + " | ".join(f"{rss[a][name]['peak_growth_kb'] / 1024:.0f} MB "
                           f"({rss[a][name]['peak_growth_kb'] * 1024 / vector_bytes:.1f} x d)" for a in rss) + " |")

    print("\npersistent buffers vs horizon (after one release, all buffers are allocated then)\n")
    print("| stream | horizon 64 | horizon 1024 | horizon 2048 |")
    print("|---|---|---|---|")
    small = torch.zeros(args.d, dtype=torch.float32)
    for name in ("blt 3", "tree"):
        cells = []
        for horizon in (64, 1024, 2048):
            stream = build(name, horizon=horizon)
            stream.add_(small, std_of(stream, 1))
            nbytes = buffer_bytes(stream)
            cells.append(f"{nbytes / vector_bytes:g} x d ({nbytes / 2 ** 20:.1f} MB)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nfinished {datetime.datetime.now(datetime.timezone.utc):%H:%M} UTC, load average "
          f"{os.getloadavg()[0]:.2f}; peak RSS of this process "
          f"{_hwm_kb() / 1024:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
