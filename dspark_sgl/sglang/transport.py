"""The tensor data plane of training capture: hidden-state rows move from the engine's writer to a trainer rank as raw
model-dtype bytes, never as JSON lists.

The control plane is `training/stream.py`'s (keys, credits, byte budget, re-send, de-duplication, ledger); a
request names where its rows go with a `Route`, which travels in the SGLang request id (`Route.rid`), so SGLang
itself needs no patch and other requests are untouched. Two transports behind one interface:

  shm   same host. The trainer rank owns a ring in /dev/shm (`ShmRing`); each request carries its region. The
        writer does ONE copy from SGLang's (pinned) row buffer into the region; the trainer reads it in place with
        `torch.frombuffer`. Every region starts with a stamp (key, attempt) the trainer writes when it allocates it;
        the writer checks it first, so a late writer of a re-sent request never overwrites a reused region.
  dist  across hosts. A two-member torch.distributed group per (writer, trainer rank, generation), made with SGLang's
        `init_custom_process_group` (gloo on CPU, NCCL on GPU) over a TCPStore that the trainer rank hosts. The writer
        sends a small header (key, attempt, n, width, dtype) then the rows from a bounded background sender; a
        trainer thread receives them. A broken pair (dead engine, timeout) is dropped on both sides, its keys are
        re-sent through a fresh pair (next generation): nothing is lost.

Writer side: `Writer.deliver(route, rows)`, one per process (`writer()`), called by the SGLang hook on attn-TP rank
0 (`dspark_sgl.sglang.capture`) or by a transformers engine. Trainer side: `ShmRing` and `PairReceiver`, driven by
`training.stream.StreamClient`. Nothing here imports SGLang at module level.
"""

from __future__ import annotations

import datetime
import mmap
import os
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

TAG = "dspark-cap"
STAMP_BYTES = 16  # int64 key, int64 attempt at the start of every shm region
ALIGN = 64
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
SHM_DIR = Path("/dev/shm")


class TransportError(RuntimeError):
    """A route that cannot carry a capture (bad tag, region too small, ring too small for one sample)."""


# ---- routes: where one request's rows go ---------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    kind: str  # "shm" | "dist"
    key: int  # the stream key (unique per request in a run)
    attempt: int  # 0 for the first send, +1 per re-send (part of the rid: SGLang request ids must be unique)
    where: str  # shm: ring file name; dist: host:port of the trainer's TCPStore
    offset: int = 0  # shm: region start (its stamp) in the ring
    capacity: int = 0  # shm: payload bytes the region holds
    group: str = ""  # dist: pair group name (changes when a pair breaks)
    backend: str = "gloo"  # dist: gloo | nccl

    @property
    def rid(self) -> str:
        """The SGLang request id that carries this route (no '|' in names, checked on parse)."""
        if self.kind == "shm":
            return f"{TAG}|shm|{self.key}|{self.attempt}|{self.where}|{self.offset}|{self.capacity}"
        return f"{TAG}|dist|{self.key}|{self.attempt}|{self.where}|{self.group}|{self.backend}"


def parse_rid(rid) -> Route | None:
    """The route in a request id, or None for every request that is not a tagged capture."""
    if not isinstance(rid, str) or not rid.startswith(TAG + "|"):
        return None
    parts = rid.split("|")
    try:
        if parts[1] == "shm" and len(parts) == 7:
            return Route("shm", int(parts[2]), int(parts[3]), parts[4], int(parts[5]), int(parts[6]))
        if parts[1] == "dist" and len(parts) == 7:
            return Route("dist", int(parts[2]), int(parts[3]), parts[4], group=parts[5], backend=parts[6])
    except ValueError:
        pass
    raise TransportError(f"malformed capture request id {rid!r}")


# ---- shared memory ------------------------------------------------------------------------------------------------
def _map(name: str, size: int | None = None) -> mmap.mmap:
    path = SHM_DIR / name
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0), 0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size or 0)
    finally:
        os.close(fd)


class ShmRing:
    """A trainer rank's ring of capture regions in /dev/shm, allocated in request order, freed when consumed.

    Regions are placed at the head and wrap to 0; the oldest live region bounds the head, so memory is reused in
    the order the trainer consumes (a region freed out of order waits for those before it). `view` is a tensor over
    the ring itself (torch.frombuffer): the trainer reads the engine's bytes where they landed."""

    def __init__(self, size: int, name: str | None = None):
        self.name = name or f"dspark-ring-{os.getpid()}-{id(self):x}"
        self.size = size
        self.mm = _map(self.name, size)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.live: deque[list] = deque()  # [offset, size, reusable_at or None] in allocation order
        self.by_key: dict[tuple[int, int], list] = {}
        self.head = 0

    @staticmethod
    def region_bytes(payload: int) -> int:
        return (STAMP_BYTES + payload + ALIGN - 1) // ALIGN * ALIGN

    def alloc(self, key: int, attempt: int, payload: int) -> Route | None:
        """A stamped region for `payload` bytes, or None while the ring is full (consume first)."""
        need = self.region_bytes(payload)
        if need > self.size:
            raise TransportError(f"a {payload}-byte capture does not fit the {self.size}-byte shm ring; raise "
                                 "stream.byte_budget_mb")
        self._reclaim()
        at = self._place(need)
        if at is None:
            return None
        region = [at, need, None]
        self.live.append(region)
        self.by_key[(key, attempt)] = region
        self.head = at + need
        self.buf[at:at + STAMP_BYTES].view(torch.int64).copy_(torch.tensor([key, attempt]))
        return Route("shm", key, attempt, self.name, at, need - STAMP_BYTES)

    def _place(self, need: int) -> int | None:
        if not self.live:
            self.head = 0
            return 0
        oldest = self.live[0][0]
        if self.head > oldest:  # not wrapped: [head, size) then [0, oldest)
            if self.head + need <= self.size:
                return self.head
            return 0 if need <= oldest else None
        return self.head if self.head + need <= oldest else None

    def view(self, route: Route, nbytes: int) -> torch.Tensor:
        """The payload bytes of a written region, in place."""
        if nbytes > route.capacity:
            raise TransportError(f"reply of {nbytes} bytes for a {route.capacity}-byte region (key {route.key})")
        start = route.offset + STAMP_BYTES
        return self.buf[start:start + nbytes]

    def holds(self, key: int, attempt: int) -> bool:
        return (key, attempt) in self.by_key

    def free(self, key: int, attempt: int, delay_s: float = 0.0) -> None:
        """Give a region back. Its stamp is cleared at once, so a writer that has not checked it yet skips it; a
        re-sent request's region is reused only after `delay_s` (a writer already past its check has landed)."""
        region = self.by_key.pop((key, attempt), None)
        if region is None:
            return
        region[2] = time.monotonic() + delay_s
        self.buf[region[0]:region[0] + STAMP_BYTES].view(torch.int64).fill_(-1)
        self._reclaim()

    def _reclaim(self) -> None:
        now = time.monotonic()
        while self.live and self.live[0][2] is not None and self.live[0][2] <= now:
            self.live.popleft()

    @property
    def fenced(self) -> bool:
        """Some region of a re-sent key is waiting out its delay (space that will come back by itself)."""
        return any(r[2] is not None and r[2] > time.monotonic() for r in self.live)

    @property
    def bytes_live(self) -> int:
        return sum(r[1] for r in self.live if r[2] is None)

    def close(self) -> None:
        self.buf = None
        try:
            self.mm.close()
        except BufferError:  # a tensor view is still alive somewhere; the unlink below still frees it at exit
            pass
        (SHM_DIR / self.name).unlink(missing_ok=True)


# ---- torch.distributed pairs --------------------------------------------------------------------------------
def pair_group(store: dist.Store, group: str, rank: int, backend: str, timeout_s: float):
    """The two-member process group of one (writer, trainer rank) pair: SGLang's `init_custom_process_group` (the
    weight-update groups use it too); a trainer without SGLang makes the identical call to torch's helper."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        from sglang.srt.utils.common import init_custom_process_group
    except ImportError:
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper

        pg, _ = _new_process_group_helper(2, rank, [], Backend(backend), store, group_name=group, timeout=timeout)
        return pg
    return init_custom_process_group(backend=backend, store=store, world_size=2, rank=rank, group_name=group,
                                     timeout=timeout)


def _header(route: Route, rows: torch.Tensor) -> torch.Tensor:
    return torch.tensor([route.key, route.attempt, rows.shape[0], rows.shape[1], DTYPE_CODES[rows.dtype]])


@dataclass
class Arrival:
    """Rows that came over a pair (or the event that a pair broke, rows None)."""
    engine: int
    generation: int
    key: int = -1
    attempt: int = -1
    rows: torch.Tensor | None = None
    error: str = ""


class _Pair:
    """The trainer end of one pair: a thread that joins the group, then receives while requests are outstanding."""

    def __init__(self, owner: PairReceiver, engine: int, generation: int):
        self.owner, self.engine, self.generation = owner, engine, generation
        self.group = f"{owner.prefix}-e{engine}-g{generation}"
        self.outstanding = 0
        self.cond = threading.Condition()
        self.dead = False
        threading.Thread(target=self._run, daemon=True, name=self.group).start()

    def expect(self) -> None:
        with self.cond:
            self.outstanding += 1
            self.cond.notify()

    def _run(self) -> None:
        o = self.owner
        try:
            pg = pair_group(o.store, self.group, 0, o.backend, o.timeout_s)
            while not self.dead:
                with self.cond:
                    while self.outstanding == 0 and not self.dead:
                        self.cond.wait()
                if self.dead:
                    return
                head = torch.empty(5, dtype=torch.int64)
                pg.recv([head], 1, 0).wait()
                key, attempt, n, width, code = head.tolist()
                rows = torch.empty(n, width, dtype=CODE_DTYPES[code], device=o.device)
                pg.recv([rows], 1, 1).wait()
                with self.cond:
                    self.outstanding -= 1
                o.arrivals.put(Arrival(self.engine, self.generation, key, attempt, rows))
        except Exception as e:  # dead writer, timeout, torn connection: the client re-sends through a new pair
            self.dead = True
            o.arrivals.put(Arrival(self.engine, self.generation, error=f"{type(e).__name__}: {e}"))


class PairReceiver:
    """A trainer rank's end of the dist transport: its TCPStore and one live pair per engine."""

    def __init__(self, host: str, port: int = 0, backend: str = "gloo", timeout_s: float = 600.0,
                 prefix: str | None = None, device: str = "cpu"):
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.where = f"{host}:{self.store.port}"
        self.prefix = prefix or f"dspark-{uuid.uuid4().hex[:12]}"  # group names are per-process unique
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self.arrivals: queue.Queue[Arrival] = queue.Queue()
        self.pairs: dict[int, _Pair] = {}
        self.generations: dict[int, int] = {}

    def route(self, engine: int, key: int, attempt: int) -> Route:
        pair = self.pairs.get(engine)
        if pair is None or pair.dead:
            gen = self.generations.get(engine, -1) + 1
            self.generations[engine] = gen
            pair = self.pairs[engine] = _Pair(self, engine, gen)
        pair.expect()
        return Route("dist", key, attempt, self.where, group=pair.group, backend=self.backend)

    def broken(self, arrival: Arrival) -> bool:
        """True when the arrival reports the CURRENT pair of its engine broken (old generations are ignored)."""
        pair = self.pairs.get(arrival.engine)
        return arrival.rows is None and pair is not None and pair.generation == arrival.generation

    def drain(self) -> list[Arrival]:
        out = []
        while True:
            try:
                out.append(self.arrivals.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        for p in self.pairs.values():
            with p.cond:
                p.dead = True
                p.cond.notify()


# ---- writer side ---------------------------------------------------------------------------------------------------
class _PairSender:
    """The writer end of one pair: a bounded queue drained by a thread that joins the group and sends."""

    def __init__(self, route: Route, queue_size: int, timeout_s: float):
        self.route, self.timeout_s = route, timeout_s
        self.items: queue.Queue = queue.Queue(queue_size)
        self.dead = False
        threading.Thread(target=self._run, daemon=True, name=f"dspark-send-{route.group}").start()

    def put(self, route: Route, rows: torch.Tensor) -> bool:
        if self.dead:
            return False
        try:
            self.items.put((route, rows), timeout=self.timeout_s)  # backpressure on the scheduler, bounded
            return True
        except queue.Full:
            return False  # the trainer times the key out and re-sends it

    def _run(self) -> None:
        host, port = self.route.where.rsplit(":", 1)
        try:
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            pg = pair_group(store, self.route.group, 1, self.route.backend, self.timeout_s)
            while True:
                route, rows = self.items.get()
                if self.route.backend == "nccl":
                    rows = rows.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
                try:
                    pg.send([_header(route, rows)], 0, 0).wait()
                    pg.send([rows.contiguous()], 0, 1).wait()
                finally:
                    self.items.task_done()
        except Exception:
            self.dead = True
            while not self.items.empty():  # dropped: the trainer re-sends them through its next pair
                self.items.get_nowait()
                self.items.task_done()


class Writer:
    """Delivers captured rows [n, W] to the route of their request (one per process; see `writer()`).

    A pair's queue (`queue_size`, above any trainer's credits) only fills when its sender is stuck (joining a group
    its trainer already gave up, a hung peer): then `deliver` waits at most `timeout_s` and drops the rows, so a
    broken pair never stalls the scheduler for longer; the trainer re-sends those keys through its next pair."""

    def __init__(self, queue_size: int = 64, timeout_s: float = 60.0):
        self.queue_size, self.timeout_s = queue_size, timeout_s
        self.rings: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self.pairs: dict[tuple[str, str], _PairSender] = {}

    def deliver(self, route: Route, rows: torch.Tensor) -> bool:
        """True when the rows were written (shm) or queued (dist); False when dropped (a stale region, a dead pair):
        the trainer then re-sends the key."""
        if route.kind == "shm":
            return self._write_shm(route, rows)
        sender = self.pairs.get((route.where, route.group))
        if sender is None or sender.dead:
            sender = self.pairs[(route.where, route.group)] = _PairSender(route, self.queue_size, self.timeout_s)
        return sender.put(route, rows)

    def _write_shm(self, route: Route, rows: torch.Tensor) -> bool:
        if route.where not in self.rings:
            try:
                mm = _map(route.where)
            except FileNotFoundError:
                raise TransportError(f"no shm ring {route.where!r} on this host: transport.kind=shm needs the engine "
                                     "on the trainer rank's host (use transport.kind=dist across hosts)") from None
            self.rings[route.where] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        buf = self.rings[route.where][1]
        stamp = buf[route.offset:route.offset + STAMP_BYTES].view(torch.int64).tolist()
        if stamp != [route.key, route.attempt]:
            return False  # the trainer re-sent this key and reused the region: not ours any more
        nbytes = rows.numel() * rows.element_size()
        if nbytes > route.capacity:
            raise TransportError(f"capture of {tuple(rows.shape)} {rows.dtype} ({nbytes} B) exceeds its "
                                 f"{route.capacity}-byte shm region (key {route.key})")
        start = route.offset + STAMP_BYTES
        dst = buf[start:start + nbytes].view(rows.dtype).view(rows.shape)
        dst.copy_(rows)  # the one copy: SGLang's row buffer (pinned host or device) -> the trainer's ring
        return True


_WRITER: Writer | None = None
_WRITER_LOCK = threading.Lock()


def writer() -> Writer:
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None:
            _WRITER = Writer()
        return _WRITER


def wait_sent(timeout_s: float = 30.0) -> None:
    """Block until this process's dist senders have handed over what they queued (tests, orderly shutdown)."""
    deadline = time.monotonic() + timeout_s
    for s in list(writer().pairs.values()):
        while not s.dead and s.items.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
