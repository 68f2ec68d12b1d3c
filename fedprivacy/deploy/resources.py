"""Per-client resource report: a Flower mod measuring each ClientApp call on the SuperNode.

For every message a SuperNode's ClientApp handles, :func:`resource_mod` measures

- ``seconds``: wall time of the ClientApp (decode, local training, encode), and ``cpu_seconds``;
- ``peak_rss_bytes``: the peak resident memory of the ClientApp process (``ru_maxrss``). Under
  Flower 1.41's deployment runtime every message runs in a fresh ``flwr-clientapp`` process, so
  this is the device's peak for that round, Python, torch and Flower included; ``rss_before_bytes``
  is the resident memory when the call started (imports and the broadcast already loaded), so
  ``peak - before`` bounds what training itself added;
- ``bytes_down`` / ``bytes_up``: payload bytes of the incoming and outgoing message content
  (``count_bytes()`` of every record: arrays, configs, metrics), i.e. what the device receives and
  sends per round before Flower's protobuf/HTTP framing and TLS.

Each measurement is appended as one JSON line to the file named by the SuperNode's node config
``resource-log`` (a device keeps its own log; :func:`collect` merges a local deployment's logs into
``resources.csv`` and a per-client summary). Nothing is added to the reply, so the measurement
never changes what the server receives. The mod never fails a call: a logging error is swallowed.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

log = logging.getLogger(__name__)

RESOURCE_LOG_KEY = "resource-log"
RESOURCES_CSV = "resources.csv"
RESOURCES_SUMMARY = "resources_summary.json"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _content_bytes(msg: Message) -> int:
    if not msg.has_content():
        return 0
    return int(sum(record.count_bytes() for record in msg.content.values()))


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def resource_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: run the ClientApp, append its resource use to ``node_config["resource-log"]``."""
    rss_before, cpu0, t0 = _rss_bytes(), _cpu_seconds(), time.perf_counter()
    reply = call_next(msg, context)
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    path = context.node_config.get(RESOURCE_LOG_KEY)
    if path:
        try:
            config = msg.content.config_records.get("config") if msg.has_content() else None
            secagg = msg.content.config_records.get("secagg") if msg.has_content() else None
            if config is None and secagg is not None:  # a SecAgg+ stage without the model: its round
                config = {"server-round": secagg["round"]}
            row = {
                "partition": int(context.node_config.get("partition-id", -1)),
                "node_id": context.node_id,
                "message_type": msg.metadata.message_type,
                "stage": str(secagg["stage"]) if secagg is not None and "stage" in secagg else "",
                "round": int(config["server-round"]) if config is not None and "server-round" in config else 0,
                "seconds": seconds,
                "cpu_seconds": cpu,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
                "rss_before_bytes": rss_before,
                "bytes_down": _content_bytes(msg),
                "bytes_up": _content_bytes(reply),
                "failed": reply.has_error(),
                "pid": os.getpid(),
                "time": time.time(),
            }
            with open(str(path), "a") as f:
                f.write(json.dumps(row) + "\n")
        except Exception as err:  # noqa: BLE001 - measuring must never break a client
            log.warning("resource report for %s not written: %s", path, err)
    return reply


class MeasuredClientApp(ClientApp):
    """Wrap an existing ClientApp (with whatever mods it already has) in :func:`resource_mod`."""

    def __init__(self, inner: ClientApp) -> None:
        super().__init__()
        self._inner = inner

    def __call__(self, message: Message, context: Context) -> Message:
        return resource_mod(message, context, self._inner)


def collect(log_dir: Path, output_dir: Path) -> dict[str, Any]:
    """Merge the SuperNodes' resource logs into ``output_dir/resources.csv`` and return (and write)
    a per-client summary of the training rounds (``message_type == "train"``, the calls of one round summed)."""
    import pandas as pd

    rows = []
    for path in sorted(Path(log_dir).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed SuperNode
    output_dir.mkdir(parents=True, exist_ok=True)
    if not rows:
        summary: dict[str, Any] = {"clients": {}}
    else:
        df = pd.DataFrame(rows).sort_values(["partition", "round", "time"])
        df.to_csv(output_dir / RESOURCES_CSV, index=False)
        # one row per client and round: a SecAgg+ round's four stage calls (column ``stage``) add up
        train = df[df["message_type"] == "train"].groupby(["partition", "round"], as_index=False).agg(
            seconds=("seconds", "sum"), peak_rss_bytes=("peak_rss_bytes", "max"),
            rss_before_bytes=("rss_before_bytes", "max"), bytes_down=("bytes_down", "sum"),
            bytes_up=("bytes_up", "sum"), failed=("failed", "sum"))
        clients = {}
        for partition, g in train.groupby("partition"):
            clients[str(partition)] = {
                "rounds": int(len(g)),
                "seconds_per_round_mean": float(g["seconds"].mean()),
                "seconds_per_round_max": float(g["seconds"].max()),
                "peak_rss_mb": float(g["peak_rss_bytes"].max() / 2**20),
                "rss_before_call_mb": float(g["rss_before_bytes"].max() / 2**20),
                "bytes_down_per_round": float(g["bytes_down"].mean()),
                "bytes_up_per_round": float(g["bytes_up"].mean()),
                "failed_calls": int(g["failed"].sum()),
            }
        summary = {"clients": clients}
        if len(train):
            summary["all_clients"] = {
                "seconds_per_round_mean": float(train["seconds"].mean()),
                "peak_rss_mb_max": float(train["peak_rss_bytes"].max() / 2**20),
                "bytes_down_per_round_mean": float(train["bytes_down"].mean()),
                "bytes_up_per_round_mean": float(train["bytes_up"].mean()),
            }
    (output_dir / RESOURCES_SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary
