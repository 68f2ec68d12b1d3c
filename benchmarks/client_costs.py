"""Where one client's time goes on the tag-round workload: the ClientApp, its local SGD, and
the server's decode + clip + accumulate of its reply (one process, torch 1 thread).

    python benchmarks/client_costs.py [--data data/synthetic] [--clients 100] [--repeat 4]

Runs the ClientApp (``InProcessGrid._run_client``, as the engine does) on ``--clients`` users of a
model with random weights, then decodes and adds every reply into a ``PrivateSum``; then local SGD
alone on the same users; then the aggregation steps one by one. Prints milliseconds per client
(the last of ``--repeat`` passes, after warm-up).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from so_tag_round import _config  # noqa: E402

from fedprivacy.client.trainer import client_generator, local_sgd  # noqa: E402
from fedprivacy.engines.inprocess import InProcessGrid  # noqa: E402
from fedprivacy.fl.client_app import build_client_app  # noqa: E402
from fedprivacy.fl.records import model_to_record, record_to_update  # noqa: E402
from fedprivacy.privacy.aggregation import PrivateSum  # noqa: E402
from fedprivacy.stackoverflow_tasks import ensure_data, load_task  # noqa: E402


def _ms_per(n: int, fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("data/synthetic"))
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = _config("inprocess", 1, args.data, Path("unused"), args.clients, 1000)
    ensure_data(cfg.data)
    task = load_task(cfg.data)
    model = task.new_model()
    torch.nn.init.normal_(model.embedding.weight, std=0.01)
    broadcast = model_to_record(model)
    grid = InProcessGrid(build_client_app(cfg), task.population)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, 1
    users = np.random.default_rng(0).choice(task.population, args.clients, replace=False)
    dim = sum(p.numel() for p in model.parameters())
    n = len(users)
    for rep in range(1, args.repeat + 1):
        messages = [Message(RecordDict({"arrays": broadcast, "config": ConfigRecord({"server-round": rep})}),
                            dst_node_id=int(u) + 2, message_type="train", group_id=str(rep)) for u in users]
        replies: list[Message] = []
        app = _ms_per(n, lambda: replies.extend(grid._run_client(m, RecordDict())[0] for m in messages))
        agg = PrivateSum(dim, clip_norm=cfg.privacy.clip_norm, noise_multiplier=1.0, expected_cohort=float(n))
        server = _ms_per(n, lambda: [agg.add_(record_to_update(r.content.array_records["arrays"], dim))
                                     for r in replies])

    def sgd() -> None:
        for u in users:
            features, labels = task.client_data(int(u))
            local_sgd(model, features, labels, epochs=1, batch_size=100, lr=30.0,
                      rng=client_generator(0, 1, int(u)))

    sgd_ms = _ms_per(n, sgd)
    records = [r.content.array_records["arrays"] for r in replies]
    updates = [record_to_update(r, dim) for r in records]
    total = torch.zeros(dim)
    parts = {
        "decode the record": lambda: [record_to_update(r, dim) for r in records],
        "validate (is_well_formed)": lambda: [u.is_well_formed(dim) for u in updates],
        "L2 norm": lambda: [float(torch.linalg.vector_norm(u.values)) for u in updates],
        "row index_add_ (scaled)": lambda: [total.view(-1, u.block).index_add_(0, u.indices, u.values, alpha=0.5)
                                           for u in updates],
    }
    rows = np.mean([u.values.shape[0] for u in updates])
    print(f"{n} clients, {rows:.0f} rows x {updates[0].block} per update on average")
    print(f"ClientApp (message in -> reply out)   {app:.3f} ms per client")
    print(f"  of which local SGD alone             {sgd_ms:.3f} ms per client")
    print(f"server: decode + clip + accumulate    {server:.3f} ms per client")
    for name, fn in parts.items():
        print(f"  {name:34s} {_ms_per(n, fn):.3f} ms per client")


if __name__ == "__main__":
    main()
