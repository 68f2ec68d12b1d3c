"""CPU time of the reply path for one round of the multi-label tag study: 100 block-sparse client updates of
logistic regression 10,000 -> 500 (5,000,500 parameters; rows of 500 values, as
:func:`~fedprivacy.client.sparse_cohort.train_sparse_cohort` returns them) encoded into Flower replies and read
back by the server.

    python benchmarks/reply_path.py [--rows 1200] [--repeat 9]

Per reply, timed: :func:`~fedprivacy.fl.records.update_to_record`, the reply ``Message`` with its metrics,
:func:`~fedprivacy.fl.records.reply_content`, :func:`~fedprivacy.fl.records.reply_to_update` and the round's
:class:`~fedprivacy.fl.aggregation.Diagnostics` (not the clip and sum). ``--rows``: the median rows per client
(log-normal, sigma 0.7; 1,200 gives about 1,650 on average, the synthetic study data's 3.3 MB uplink per client);
a small value (e.g. 20) leaves the per-reply Python cost without the copy of the values into the ``.npy``
bytes. Prints the median, min and max of ``--repeat`` passes in process CPU seconds per 100 replies (the CPU
time, not the wall time: on a shared machine the wall time mostly measures the other processes); one torch
thread, glibc's heap kept as the cohort trainer keeps it (:func:`~fedprivacy.engines.heap.keep_freed_memory`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedprivacy.engines.heap import keep_freed_memory
from fedprivacy.fl.aggregation import Diagnostics
from fedprivacy.fl.records import reply_content, reply_to_update, update_to_record
from fedprivacy.updates import SparseUpdate

VOCAB, TAGS = 10_000, 500
LAYOUT = {"embedding.weight": (VOCAB, TAGS), "bias": (TAGS,)}
DIM = VOCAB * TAGS + TAGS


def updates(median_rows: int, clients: int = 100, seed: int = 0) -> list[SparseUpdate]:
    """``clients`` block updates of ``DIM`` (rows of ``TAGS`` values; row ``VOCAB`` is the bias)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(clients):
        rows = int(min(VOCAB + 1, max(1, rng.lognormal(np.log(median_rows), 0.7))))
        blocks = torch.from_numpy(np.sort(rng.choice(VOCAB + 1, rows, replace=False))).long()
        out.append(SparseUpdate(blocks, torch.randn(rows, TAGS, generator=torch.Generator().manual_seed(rows)), DIM))
    return out


def reply_round(sent: list[SparseUpdate], x: torch.Tensor) -> Diagnostics:
    """Each update as the reply the ClientApp sends, read back as the strategy reads it."""
    diagnostics = Diagnostics()
    for update in sent:
        reply = Message(RecordDict({"arrays": update_to_record(update),
                                    "metrics": MetricRecord({"train_loss": 0.5, "num-examples": 400})}),
                        dst_node_id=2, message_type="train")
        content = reply_content(reply)
        reply_to_update(content, x, LAYOUT)
        diagnostics.add(content)
    return diagnostics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1200)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    for name in ("_run_id", "_task_id", "_node_id"):  # a stand-in for the running task's identity
        setattr(TaskIdentity, name, 1)
    torch.set_num_threads(1)
    keep_freed_memory()
    sent, x = updates(args.rows), torch.zeros(DIM)
    reply_round(sent, x)  # warm-up
    seconds = []
    for _ in range(args.repeat):
        start = time.process_time()
        reply_round(sent, x)
        seconds.append(time.process_time() - start)
    rows = sum(int(u.values.shape[0]) for u in sent)
    print(f"rows={rows} cpu_s_per_100_replies median={statistics.median(seconds):.4f} "
          f"min={min(seconds):.4f} max={max(seconds):.4f}")


if __name__ == "__main__":
    main()
