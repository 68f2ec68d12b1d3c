r"""A canary run (:mod:`fedprivacy.fl.canaries`) against a correct or a deliberately broken server, at a chosen size.

The run is ``fedprivacy run``'s own server (:class:`~fedprivacy.fl.server_app.DPFedAvgServer`) in the in-process
engine, its population the synthetic users of the test suite (40 users in TFF's SQLite format, mean 40 examples)
and ``--canaries`` canary clients; its strategy is the real one (``correct``), one of the round audit's broken
servers (:data:`fedprivacy.audit.BROKEN_VARIANTS`, e.g. ``noise_halved``: noise std zC/2 while z is accounted), or
``unclipped`` (:class:`UnclippedUploads`: the uploads summed as they come, no clip at all). The run writes its
``summary.json`` (``empirical_epsilon``: Andrew et al.'s estimate, arXiv:2302.03098 Alg. 1, with its bootstrap
interval, and Steinke et al.'s bound, arXiv:2305.08846 Thm. 3.1, against the claim) to ``--out``; the wall time
is printed. docs/audit.md's tables are ``fedprivacy report OUT --summary docs/results/NAME.json`` of such runs.

    python benchmarks/canary_broken_servers.py --server noise_halved --canaries 500 --rounds 60 --cohort 54 \
        --out runs/canary_noise_halved [--norm 10] [--z 1.0] [--vocab 200 --tags 10]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from flwr.serverapp import ServerApp

from fedprivacy.audit import BROKEN_VARIANTS
from fedprivacy.config import build_config
from fedprivacy.data.synthetic import generate
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl.canaries import population_with_canaries
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.server_app import DPFedAvgServer
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.mechanism import GaussianMechanism
from fedprivacy.stackoverflow_tasks import load_task
from fedprivacy.updates import SparseUpdate


class _UnclippedSum(PrivateSum):
    """Sums every upload as it comes (clip bound infinite while adding) and noises the sum with std zC."""

    def add_(self, update: SparseUpdate, *args, **kwargs) -> bool:
        clip_norm, self.clip_norm = self.clip_norm, math.inf
        try:
            return super().add_(update, *args, **kwargs)
        finally:
            self.clip_norm = clip_norm


class _UnclippedMechanism(GaussianMechanism):
    """BROKEN on purpose: no upload is clipped; the noise and the accountant assume each was clipped to C."""

    def aggregator(self, dim: int) -> PrivateSum:
        return _UnclippedSum(dim, clip_norm=self.clip_norm, noise_multiplier=self.value_noise_multiplier,
                             expected_cohort=float(self.expected_cohort), device=self.device, placement=self.placement)


UnclippedUploads = type("UnclippedUploads", (DPFedAvg,), {"mechanism_cls": _UnclippedMechanism,
                                                          "prefetch_noise": False,
                                                          "__doc__": _UnclippedMechanism.__doc__})
SERVERS = {"correct": DPFedAvg, "unclipped": UnclippedUploads, **BROKEN_VARIANTS}


def canary_run(server: str, overrides: list[str], data: Path) -> tuple[dict, float]:
    """Run ``server`` (a key of :data:`SERVERS`) on the config of ``overrides`` over the users in ``data``: its
    summary and wall seconds."""
    cfg = build_config({"data": {"path": str(data), "generate_if_missing": False}}, overrides)
    task, out = load_task(cfg.data), {}
    app = ServerApp()

    @app.main()
    def main(grid, context):
        out["summary"] = DPFedAvgServer(cfg, task, strategy_cls=SERVERS[server]).run(grid)

    start = time.perf_counter()
    run_inprocess(app, build_client_app(cfg), population_with_canaries(cfg, task.population))
    return out["summary"], time.perf_counter() - start


def run_overrides(out: Path, *, canaries: int, unused: int, rounds: int, cohort: int, z: float = 1.0,
                  norm: float = 2.0, vocab: int = 2000, tags: int = 50, seed: int = 3) -> list[str]:
    """The run's config: the test suite's small config (1 local epoch, batch 10, lr 5, C = 1), pld at delta 1e-5,
    ``canaries`` canaries with ``unused`` unused directions of ``norm`` (privacy.canaries.norm) and ``seed``."""
    return [f"output_dir={out}", f"rounds={rounds}", f"eval_every={rounds}", f"checkpoint_every={rounds}",
            f"data.vocab_size={vocab}", f"data.num_tags={tags}", "client.epochs=1", "client.batch_size=10",
            "client.lr=5.0", "privacy.clip_norm=1.0", f"privacy.noise_multiplier={z}",
            f"privacy.expected_cohort={cohort}", "privacy.delta=1e-5", "privacy.accountants=[pld]",
            "privacy.budget_accountant=pld",
            f"privacy.canaries={{count: {canaries}, unused: {unused}, seed: {seed}, norm: {norm}}}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=sorted(SERVERS), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--canaries", type=int, default=40)
    ap.add_argument("--unused", type=int, default=None, help="unused directions (default: as many as canaries)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--cohort", type=int, default=8)
    ap.add_argument("--z", type=float, default=1.0)
    ap.add_argument("--norm", type=float, default=2.0, help="privacy.canaries.norm")
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--tags", type=int, default=50)
    ap.add_argument("--seed", type=int, default=3, help="privacy.canaries.seed")
    args = ap.parse_args()
    overrides = run_overrides(args.out, canaries=args.canaries,
                              unused=args.canaries if args.unused is None else args.unused, rounds=args.rounds,
                              cohort=args.cohort, z=args.z, norm=args.norm, vocab=args.vocab, tags=args.tags,
                              seed=args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp), num_clients=40, seed=1, min_examples=1, mean_examples=40, max_examples=800)
        summary, wall = canary_run(args.server, overrides, Path(tmp))
    e = summary["empirical_epsilon"]
    a = e.get("andrew", {})
    print(f"{args.server}: claim {e['epsilon_claimed']:.3g}, andrew {a.get('epsilon', math.nan):.3g} "
          f"{a.get('interval')}, steinke {e.get('steinke', {}).get('epsilon_lower_bound')}, {wall:.0f} s wall")


if __name__ == "__main__":
    main()
