"""Per-client resources on a real Flower deployment, one row per client optimizer.

Each variant runs ``fedprivacy deploy local`` (a SuperLink and ``--supernodes`` SuperNodes as OS
processes, plaintext for speed: TLS does not change the ClientApp's work) for ``--rounds`` rounds
of the default tag model (logistic regression 10,000 -> 500, 5,000,500 parameters) on the first
users of the synthetic data, and reads the deployment's own resource report
(``resources_summary.json``, written by :mod:`fedprivacy.deploy.resources`): peak RSS of the
ClientApp process, seconds per round in the ClientApp, bytes down and up per round (payload,
before protobuf/HTTP framing). Under Flower 1.41 every message runs in a fresh ``flwr-clientapp``
process, so the peak includes Python, torch and Flower (~400 MB); ``train MB`` is the growth during
the call (peak minus the resident memory when the call started), which is what the optimizer adds.

    python benchmarks/client_resources.py [--supernodes 2] [--rounds 2] [--only plain sdp-adam ...]

Prints a Markdown table (and writes it with the raw summaries to ``--out``). Optimizer-state bytes
per parameter (DP-MicroAdam vs DP-Adam) are measured separately by ``optimizer_state_memory.py``
(a ClientApp process's peak is dominated by Python, torch and the 20 MB model copies).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from fedprivacy.config import build_config

SAMPLE_DP = {"lr": 0.5, "noise_multiplier": 1.0, "clip_norm": 1.0, "batch_size": 16.0, "epochs": 1.0}

# variant -> (label, config overrides: the client section, and the privacy placement where it is the point)
VARIANTS: dict[str, tuple[str, dict]] = {
    "plain": ("local SGD, central noise", {}),
    "local-noise": ("local SGD, local noise (client clips + noises)", {"privacy": {"placement": "local"}}),
    "sdp-sgd": ("sample-DP SGD", {"client": {"sample_dp": {**SAMPLE_DP, "optimizer": "sgd"}}}),
    "sdp-adam": ("sample-DP Adam", {"client": {"sample_dp": {**SAMPLE_DP, "optimizer": "adam", "lr": 0.01}}}),
    "sdp-adambc": ("sample-DP AdamBC", {"client": {"sample_dp": {**SAMPLE_DP, "optimizer": "adambc", "lr": 0.01}}}),
    "sdp-microadam": ("sample-DP MicroAdam",
                      {"client": {"sample_dp": {**SAMPLE_DP, "optimizer": "microadam", "lr": 0.01}}}),
    "sdp-disk": ("sample-DP SGD + DiSK (kappa 0.7)",
                 {"client": {"sample_dp": {**SAMPLE_DP, "optimizer": "sgd", "disk_kappa": 0.7, "disk_gamma": 0.5}}}),
    "adadps": ("local SGD, AdaDPS A (top 100 words)", {"client": {"adadps": {"source": "top_words"}, "lr": 0.15}}),
    "compressed": ("local SGD, top-1% upload + 4-bit residual", {"client": {"compression": {"density": 0.01}}}),
}


def variant_config(name: str, data: Path, out: Path, supernodes: int, rounds: int):
    over = VARIANTS[name][1]
    return build_config({
        "rounds": rounds, "eval_every": 10**6, "output_dir": str(out), "seed": 0,
        "data": {"path": str(data)},
        "client": {"epochs": 1, "batch_size": 100, "lr": 30.0, **over.get("client", {})},
        "privacy": {"clip_norm": 10.0, "noise_multiplier": 1.0, "expected_cohort": supernodes,
                    "accountants": ["rdp"], **over.get("privacy", {})},
    })


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--supernodes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", type=Path, default=Path("data/synthetic"))
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), metavar="VARIANT")
    ap.add_argument("--out", type=Path, default=Path("runs/client_resources"))
    args = ap.parse_args()

    from fedprivacy.deploy.local import deploy_local

    rows = []
    for name in args.only or VARIANTS:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = variant_config(name, args.data, Path(tmp) / "run", args.supernodes, args.rounds)
            t0 = time.perf_counter()
            deploy_local(cfg, args.supernodes, secure=False, timeout=900, printer=lambda line: None)
            wall = time.perf_counter() - t0
            report = json.loads((Path(tmp) / "run" / "resources_summary.json").read_text())
        clients = report["clients"].values()
        rows.append({
            "variant": VARIANTS[name][0],
            "peak_rss_mb": max(c["peak_rss_mb"] for c in clients),
            "train_growth_mb": max(c["peak_rss_mb"] - c["rss_before_call_mb"] for c in clients),
            "seconds_per_round": report["all_clients"]["seconds_per_round_mean"],
            "bytes_down_per_round": report["all_clients"]["bytes_down_per_round_mean"],
            "bytes_up_per_round": report["all_clients"]["bytes_up_per_round_mean"],
            "deployment_wall_s": wall,
        })
        print(json.dumps(rows[-1]), flush=True)
    table = ["| client optimizer | peak RSS (MB) | train MB (peak - before) | ClientApp s/round | down MB/round | up MB/round |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['variant']} | {r['peak_rss_mb']:.0f} | {r['train_growth_mb']:.0f} | {r['seconds_per_round']:.2f} | "
              f"{r['bytes_down_per_round'] / 1e6:.2f} | {r['bytes_up_per_round'] / 1e6:.3f} |" for r in rows]
    header = (f"{args.supernodes} SuperNodes, {args.rounds} rounds, {platform.machine()} "
              f"{platform.processor() or ''}, {time.strftime('%Y-%m-%d')}")
    print(header)
    print("\n".join(table))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client_resources.json").write_text(json.dumps({"setup": header, "rows": rows}, indent=2))
    (args.out / "client_resources.md").write_text(header + "\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
