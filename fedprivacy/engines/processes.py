"""Worker processes for the in-process engine: ClientApps on every core, replies in message order.

The grid's own process and ``processes - 1`` forked workers take a batch's messages from one
shared counter (whoever is free runs the next message), and :meth:`ProcessPool.run` yields the
replies in the order the messages were sent. The ServerApp therefore aggregates exactly the
replies, in exactly the order, of the one-process engine: a client's reply is a deterministic
function of its message, its node's state and the run seed, so the model is bit-identical
whichever process ran which client (``tests/engine/test_processes.py``).

Transport: bulk bytes go through shared memory, not pipes (a pipe moves a 20 MB broadcast in
hundreds of chunks, and each chunk waits for the GIL of a busy process). A batch is pickled once,
straight into a shared buffer every worker reads; each worker writes its replies into its own
shared ring buffer, an update's large payloads copied there directly and the rest pickled after
them. The pipes carry only small notices (batch ready, batch loaded, reply at offset). The grid's
process reads them itself between the clients it runs: no threads.

- The messages of a round share their broadcast ``ArrayRecord`` (and DiSK's lookahead, AdaDPS's
  ``A``); pickle writes a shared object once.
- Nodes' ``Context.state`` stays with the grid (it is checkpointed there): the non-empty states of
  the batch's nodes travel with the batch, and the state a ClientApp leaves comes back with its
  reply.
- A batch too small to pay its hand-over runs in the grid's process alone (:data:`FAN_OUT_FACTOR`:
  measured seconds per client here and per hand-over, never a fixed size, so a 10-client LSTM round
  still fans out while a 10-client round of the sparse tag model does not); the replies are the same.
- At most ``window`` messages are claimed and not yet yielded (a semaphore), so the replies held
  while an earlier one is still running are bounded (dense 20 MB updates stay affordable).
- A worker that dies (killed, out of memory) loses only the message it was running: that reply is
  an error, which the ServerApp counts as a dropout (invariant 11); the remaining messages run on
  the processes left. Workers ignore Ctrl-C (the grid's process handles it and closes them) and
  die with the grid's process, even mid-client (Linux: ``PR_SET_PDEATHSIG``; elsewhere when they
  next wait for work), however it ended (``kill -9`` included).

Workers are forked (POSIX), so they share the loaded task's memory-mapped data and the ClientApp
object itself without pickling it; CUDA cannot be used in forked processes, so the config allows
several processes with ``device: cpu`` only.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import mmap
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from flwr.app import Error, Message, RecordDict

if TYPE_CHECKING:
    from fedprivacy.config import RunConfig

log = logging.getLogger(__name__)

WORKER_DIED = 2  # error code of the reply to a message whose worker process died while running it
RING_BYTES = 64 << 20  # each worker's reply ring; a reply pickle over a quarter of it travels through the pipe instead
OUT_OF_BAND_BYTES = 1 << 16  # a reply's bytes objects from this size on are copied into the ring, not into its pickle
FAN_OUT_FACTOR = 5.0
"""A batch goes to the workers only when its expected serial time (its size times the measured seconds
per client here) is at least this many times the last measured hand-over (pickling the batch here plus
the slowest worker's unpickling). Below it the hand-over delays the workers past most of the batch
while they compete for the cores with this process and its noise thread: on 2 cores, a 10-client
round of the 5M-parameter tag model ran 1.2x faster in one process than on two (BENCHMARKS.md)."""
RunClient = Callable[[Message, RecordDict], tuple[Message, RecordDict]]
"""Run a message's ClientApp with its node's state; return the reply and the node's new state."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity set where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def run_processes(cfg: RunConfig) -> int:
    """The cores a run's clients use: ``cfg.processes``, or when it is ``None`` every usable core for
    the in-process engine on the CPU (:func:`usable_cores`), else 1."""
    if cfg.processes is not None:
        return cfg.processes
    return usable_cores() if cfg.engine == "inprocess" and cfg.device == "cpu" else 1


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this (forked) process when its parent exits (Linux; a no-op elsewhere),
    and exit now if ``parent`` is already gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # the process's own libc
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(0)


class _SharedFile:
    """A growable buffer in an unlinked tmpfs file, shared by every process that inherited its fd."""

    def __init__(self, size: int) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="fedprivacy-", dir=folder)
        os.unlink(path)  # nothing is left behind, whatever happens to the processes
        self.fd, self.map = fd, None
        self.grow(size)

    def grow(self, size: int) -> None:
        """Make the file at least ``size`` bytes (the writer's side)."""
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        self.view(size)

    def view(self, size: int) -> mmap.mmap:
        """The mapping, remapped if the file grew past it (the reader's side)."""
        if self.map is None or len(self.map) < size:
            if self.map is not None:
                self.map.close()
            self.map = mmap.mmap(self.fd, os.fstat(self.fd).st_size)
        return self.map


class _ReplyPickler(pickle.Pickler):
    """Pickles a reply with each large ``bytes`` object (an update's ``.npy`` payload) copied straight
    into the worker's ring, not into the pickle: one copy of the update fewer. The pickle names each
    by ``(ring position, length)``; :meth:`ProcessPool._receive` reads it back from there."""

    def __init__(self, file: io.BytesIO, put: Callable[[bytes], int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._put = put
        self._budget = RING_BYTES // 4  # of the ring one reply may fill this way (the rest stays in the pickle)

    def persistent_id(self, obj: object) -> tuple[int, int] | None:
        if type(obj) is bytes and OUT_OF_BAND_BYTES <= len(obj) <= self._budget:
            self._budget -= len(obj)
            return self._put(obj), len(obj)
        return None

    @classmethod
    def dumps(cls, obj: object, put: Callable[[bytes], int]) -> bytes:
        buffer = io.BytesIO()
        cls(buffer, put).dump(obj)
        return buffer.getvalue()


class ProcessPool:
    """``processes - 1`` forked workers plus the calling process, sharing batches of messages."""

    def __init__(self, run_client: RunClient, processes: int, window: int | None = None) -> None:
        if processes < 2:
            raise ValueError(f"a process pool needs at least 2 processes, got {processes}")
        if processes > usable_cores():
            log.warning("processes=%d exceeds the %d CPU cores this run may use: its processes will take turns on "
                        "them (slower); set processes <= %d", processes, usable_cores(), usable_cores())
        ctx = mp.get_context("fork")
        self._run_client = run_client
        self.window = window or 4 * processes
        self._lock = ctx.Lock()  # guards the claim counter below
        self._batch = ctx.RawValue("q", 0)  # id of the batch being claimed from
        self._next = ctx.RawValue("q", 0)  # next unclaimed message of that batch
        self._size = ctx.RawValue("q", 0)
        self._running = ctx.RawArray("q", 2 * processes)  # per worker: (batch, message) it runs
        self._consumed = ctx.RawArray("q", processes)  # per worker: ring bytes the grid has read
        self._slots = ctx.Semaphore(self.window)
        self._batch_file = _SharedFile(64 << 20)
        self._rings = {w: _SharedFile(RING_BYTES) for w in range(1, processes)}
        self._results: dict[int, tuple[Message, RecordDict]] = {}
        self._client_seconds: dict[str, float] = {}  # per message type: moving average of one ClientApp run here
        self._publish_seconds = 0.0  # pickling the last fanned-out batch here
        self._load_seconds: dict[int, float] = {}  # per worker: unpickling the last batch it read
        self._messages: Sequence[Message] = ()
        self._unanswered: set[int] = set()
        self._conns: dict[int, Connection] = {}
        self._loaded: dict[int, int] = {}  # per worker: the last batch it has read
        self._published = 0  # the last batch written to the shared buffer
        self._procs: dict[int, mp.process.BaseProcess] = {}
        parent = os.getpid()
        for w in range(1, processes):
            ours, theirs = ctx.Pipe()
            self._running[2 * w] = -1
            proc = ctx.Process(target=self._serve, args=(w, theirs, parent, ours),
                               name=f"fedprivacy-client-worker-{w}", daemon=True)
            proc.start()
            theirs.close()
            self._conns[w], self._procs[w], self._loaded[w] = ours, proc, 0

    @property
    def workers_alive(self) -> int:
        return len(self._conns)

    # -- the grid's process ------------------------------------------------------------------
    def run(self, messages: Sequence[Message], states: dict[int, RecordDict]) -> Iterator[tuple[Message, RecordDict]]:
        """Run every message's ClientApp (here or in a worker); yield ``(reply, node state)`` in order.

        ``states`` maps node ids to their non-empty ``Context.state``. Abandoning the iterator
        early waits for the messages already running and runs no more of this batch.
        """
        n = len(messages)
        self._messages, self._unanswered, self._results = messages, set(range(n)), {}
        with self._lock:
            self._batch.value += 1
            batch = self._batch.value
            self._next.value, self._size.value = 0, n
        if self._conns and n and self._worth_fanning_out(messages):
            self._publish(batch, (batch, list(messages), states))
        try:
            for i in range(n):
                yield self._reply(i, states)
        except GeneratorExit:  # the consumer stopped early: finish below
            raise
        except BaseException:  # this process failed while collecting replies: waiting on the workers could hang
            self._stop_workers(kill=True)
            raise
        finally:
            self._finish_batch()

    def _worth_fanning_out(self, messages: Sequence[Message]) -> bool:
        """Whether ``messages`` should go to the workers too (see :data:`FAN_OUT_FACTOR`); yes until both
        costs have been measured. Either way the replies are the same: only the speed depends on it."""
        loads = [self._load_seconds[w] for w in self._conns if w in self._load_seconds]
        client = self._client_seconds.get(messages[0].metadata.message_type)
        if client is None or not loads:
            return True
        return len(messages) * client >= FAN_OUT_FACTOR * (self._publish_seconds + max(loads))

    def _publish(self, batch: int, payload: object) -> None:
        """Pickle the batch into the shared buffer (once every worker has read the last one) and tell them."""
        while any(self._loaded[w] < self._published for w in self._conns):  # the buffer is about to be overwritten
            self._pump(timeout=0.5)
        started = time.perf_counter()
        size = len(self._batch_file.map)
        while True:
            buffer = self._batch_file.view(size)
            buffer.seek(0)
            try:
                pickle.dump(payload, buffer, protocol=pickle.HIGHEST_PROTOCOL)
                break
            except ValueError:  # it did not fit
                size *= 2
                self._batch_file.grow(size)
        length, self._published = buffer.tell(), batch
        self._publish_seconds = time.perf_counter() - started
        for w, conn in list(self._conns.items()):
            try:
                conn.send(("batch", batch, length))
            except OSError:
                self._worker_died(w)

    def _reply(self, i: int, states: dict[int, RecordDict]) -> tuple[Message, RecordDict]:
        """Message ``i``'s reply: run unclaimed messages here while it is not back."""
        while True:
            self._pump(timeout=0)
            if i in self._results:
                self._unanswered.discard(i)
                self._slots.release()
                return self._results.pop(i)
            k = self._claim()
            if k is not None:
                msg = self._messages[k]
                started = time.perf_counter()
                self._results[k] = self._run_client(msg, states.get(msg.metadata.dst_node_id, RecordDict()))
                self._note_client_seconds(msg.metadata.message_type, time.perf_counter() - started)
            else:
                self._pump(timeout=0.5)

    def _note_client_seconds(self, message_type: str, seconds: float) -> None:
        """Fold one ClientApp run of this process into its message type's moving average (weight 0.2)."""
        before = self._client_seconds.get(message_type)
        self._client_seconds[message_type] = seconds if before is None else 0.8 * before + 0.2 * seconds

    def _claim(self) -> int | None:
        """Claim the next message of the batch for this process (``None``: none left, or the window is full)."""
        return self._take(self._batch.value, 0) if self._slots.acquire(block=False) else None

    def _take(self, batch: int, w: int) -> int | None:
        """With a window slot held: the next message of ``batch`` for process ``w`` (0: the grid's),
        or ``None`` (slot given back) when none is left."""
        with self._lock:
            k = self._next.value
            if self._batch.value == batch and k < self._size.value:
                self._next.value = k + 1
                self._running[2 * w], self._running[2 * w + 1] = batch, k
                return k
        self._slots.release()
        return None

    def _pump(self, timeout: float) -> None:
        """Read the workers' notices (waiting up to ``timeout`` s for one): replies, loaded batches, deaths."""
        for conn in wait(list(self._conns.values()), timeout):
            w = next(w for w, c in self._conns.items() if c is conn)
            while True:
                try:
                    notice = conn.recv()
                except (EOFError, OSError):  # after every notice it sent: only its running message is lost
                    self._worker_died(w)
                    break
                if notice[0] == "loaded":
                    self._loaded[w], self._load_seconds[w] = notice[1], notice[2]
                else:
                    self._receive(w, *notice)
                if not conn.poll():
                    break

    def _receive(self, w: int, kind: str, batch: int, k: int, where: int | bytes, end: int) -> None:
        """Unpickle worker ``w``'s reply to message ``k`` (``where``: its pickle's ring position, or the
        pickle itself when it came ``inline``), fetching its large payloads from the ring; the ring
        is then free up to ``end``."""
        with memoryview(self._rings[w].view(RING_BYTES)) as ring:
            def at(position: int, length: int) -> memoryview:  # the ring's bytes written at ``position``
                return ring[position % RING_BYTES:position % RING_BYTES + length]

            unpickler = pickle.Unpickler(io.BytesIO(where if kind == "inline" else at(where, end - where)))
            unpickler.persistent_load = lambda pid: bytes(at(*pid))
            result = unpickler.load()
        self._consumed[w] = end
        self._keep(batch, k, result)

    def _keep(self, batch: int, k: int, result: tuple[Message, RecordDict]) -> None:
        if batch == self._batch.value and k in self._unanswered:
            self._results[k] = result

    def _worker_died(self, w: int) -> None:
        """Forget worker ``w``; the message it was running gets an error reply (a dropout)."""
        conn = self._conns.pop(w)
        conn.close()
        batch, k = self._running[2 * w], self._running[2 * w + 1]
        if batch == self._batch.value and k in self._unanswered and k not in self._results:
            msg = self._messages[k]
            log.warning("client worker process %d died while running node %s; that reply is a dropout", w,
                        msg.metadata.dst_node_id)
            self._results[k] = (Message(Error(code=WORKER_DIED, reason=f"client worker process {w} died"),
                                        reply_to=msg), RecordDict())
        else:
            log.warning("client worker process %d died; %d processes are left", w, len(self._conns) + 1)

    def _finish_batch(self) -> None:
        """Stop further claims, wait for what workers still run, and return every slot still held."""
        with self._lock:
            claimed = self._next.value
            self._next.value = self._size.value
        held = [k for k in self._unanswered if k < claimed]
        while self._conns and any(k not in self._results for k in held):
            self._pump(timeout=0.5)
        for _ in held:
            self._slots.release()
        self._unanswered, self._results, self._messages = set(), {}, ()

    def close(self) -> None:
        """Stop the workers (between batches: they run nothing further) and wait for them."""
        self._stop_workers(kill=False)

    def _stop_workers(self, kill: bool) -> None:
        for conn in self._conns.values():
            with contextlib.suppress(OSError):  # a worker already gone needs no stop notice
                conn.send(None)
        for proc in self._procs.values():
            proc.join(timeout=0 if kill else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns.values():
            conn.close()
        self._conns = {}

    # -- a worker process ------------------------------------------------------------------
    def _serve(self, w: int, conn: Connection, parent: int, grid_end: Connection) -> None:
        """Worker ``w``: for each batch announced, claim and run messages until none is left.

        ``grid_end`` is the grid's end of this worker's pipe; closing the copies of the grid's ends
        that the fork gave this worker lets it read EOF when the grid's process is gone."""
        die_with_parent(parent)
        for end in (grid_end, *self._conns.values()):
            end.close()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ring = self._rings[w].view(RING_BYTES)
        written = 0  # ring bytes written so far (a position; modulo RING_BYTES is the offset)

        def put(data: bytes) -> int:
            """Copy ``data`` into the ring; return its position."""
            nonlocal written
            written = self._put(w, ring, written, data, parent)
            return written - len(data)

        while True:
            try:
                notice = conn.recv()
            except (EOFError, OSError):
                return
            if notice is None:
                return
            _, batch, length = notice
            started = time.perf_counter()
            _, messages, states = pickle.loads(memoryview(self._batch_file.view(length))[:length])
            conn.send(("loaded", batch, time.perf_counter() - started))
            while (k := self._claim_in_worker(w, batch, parent)) is not None:
                msg = messages[k]
                result = self._run_client(msg, states.get(msg.metadata.dst_node_id, RecordDict()))
                try:
                    data = _ReplyPickler.dumps(result, put)
                except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an unpicklable reply: a dropout
                    data = pickle.dumps((Message(Error(code=WORKER_DIED, reason=f"reply not picklable: {exc}"),
                                                 reply_to=msg), result[1]), protocol=pickle.HIGHEST_PROTOCOL)
                if len(data) > RING_BYTES // 4:
                    conn.send(("inline", batch, k, data, written))
                    continue
                position = put(data)
                conn.send(("reply", batch, k, position, written))

    def _put(self, w: int, ring: mmap.mmap, written: int, data: bytes, parent: int) -> int:
        """Copy ``data`` into worker ``w``'s ring (contiguously; waiting while the grid has not read
        enough of it); return the new write position."""
        if written % RING_BYTES + len(data) > RING_BYTES:  # skip the ring's tail end: start at offset 0
            written += RING_BYTES - written % RING_BYTES
        while written + len(data) - self._consumed[w] > RING_BYTES:
            if os.getppid() != parent:
                os._exit(0)
            time.sleep(0.001)
        start = written % RING_BYTES
        ring[start:start + len(data)] = data
        return written + len(data)

    def _claim_in_worker(self, w: int, batch: int, parent: int) -> int | None:
        while not self._slots.acquire(timeout=1.0):
            if os.getppid() != parent:
                os._exit(0)  # the grid's process is gone
        return self._take(batch, w)
