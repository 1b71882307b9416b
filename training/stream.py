"""Streaming target hidden states from engines (producers) to trainer ranks (consumers) over ZeroMQ.

Why ZeroMQ and not torch.distributed: engines and trainers are separate jobs that start, die and restart on their
own (an SGLang server, a colocated subprocess, a host elsewhere). A torch.distributed group is all-or-nothing: one
dead member poisons every collective and cannot rejoin. ZeroMQ sockets reconnect by themselves, need no shared
rendezvous, and move multi-megabyte frames zero-copy.

Protocol (one DEALER socket per engine on the consumer side, a ROUTER on each engine):
  request  = [header {"sid", "n"}, int32 token ids]                     consumer -> engine
  reply    = [header {"sid", "n", "aux", "last", "dtype", "error"?}, aux bytes, last bytes]   engine -> consumer
The consumer owns the flow: it holds at most `credits` requests in flight and keeps in-flight plus buffered reply
bytes under `byte_budget` (credit-based backpressure; an engine never pushes unrequested data). Each sample carries
its id. A request with no reply after `timeout_s` without any message from its engine is re-sent, to any live engine
(at-least-once); a reply for an id already delivered, or no longer wanted, is dropped (de-duplication). The ledger
counts deliveries per id, so "no sample lost or seen twice" is checkable.

The features themselves may take a tensor data plane instead of the reply frames (`plane`, see
`dspark_sgl.sglang.transport`): the request header then carries a `rid` naming the route of its rows, and the reply
is only {"sid", "attempt", "via", "dtype", "rows"}. `shm`: the engine wrote the rows into this rank's ring before it
replied; `dist`: the rows arrive over a torch.distributed pair and the reply is only an acknowledgement. Everything
above (credits, budget, re-send, de-duplication, ledger) is unchanged; a broken pair re-sends its keys.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
import zmq

from dspark_sgl.dtypes import DTYPES
from dspark_sgl.sglang.transport import PairReceiver, Route, ShmRing, parse_rid, writer


class StreamError(RuntimeError):
    """The stream cannot deliver (an engine reported an error, or nothing answered for too long)."""


@dataclass
class Features:
    sid: int
    aux: torch.Tensor  # [n, K·H]
    last: torch.Tensor  # [n, H]

    @property
    def nbytes(self) -> int:
        return self.aux.numel() * self.aux.element_size() + self.last.numel() * self.last.element_size()


@dataclass
class Request:
    key: int  # unique per request in a run (the trainer's cursor: epoch * num_samples + index), not the sample id
    input_ids: list[int]


@dataclass
class Ledger:
    delivered: dict[int, int] = field(default_factory=dict)  # key -> times handed to the trainer (must stay 1)
    sent: dict[int, int] = field(default_factory=dict)  # key -> requests sent (>1 after a re-send)
    duplicates_dropped: int = 0
    resends: int = 0


# ---- producer side -----------------------------------------------------------------------------------------
def encode_reply(sid: int, aux: torch.Tensor, last: torch.Tensor) -> list:
    dtype = str(aux.dtype).removeprefix("torch.")
    header = {"sid": sid, "n": aux.shape[0], "aux": list(aux.shape), "last": list(last.shape), "dtype": dtype}
    raw = lambda t: t.contiguous().view(torch.uint8).numpy()
    return [json.dumps(header).encode(), raw(aux), raw(last)]


def serve(capture, bind: str, max_batch: int, wire_dtype: str = "bfloat16", pad_id: int = 0,
          stop_after: int | None = None, context: zmq.Context | None = None) -> None:
    """Answer capture requests forever: batch what is queued (up to max_batch), prefill, reply per sample.

    capture(input_ids [B, T], attention_mask [B, T]) -> object with .aux [B, T, K·H] and .last_hidden [B, T, H].
    Runs until `stop_after` replies were sent (tests) or the process is killed.
    """
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    dtype = DTYPES[wire_dtype]
    sent = 0
    try:
        while stop_after is None or sent < stop_after:
            if not sock.poll(1000):
                continue
            pending = []
            while len(pending) < max_batch and sock.poll(0):
                ident, header, ids = sock.recv_multipart()
                h = json.loads(header)
                pending.append((ident, h["sid"], torch.frombuffer(bytearray(ids), dtype=torch.int32).long(),
                                parse_rid(h.get("rid"))))
            sent += _answer(sock, capture, pending, dtype, pad_id)
    finally:
        sock.close()


def _answer(sock, capture, pending, dtype, pad_id) -> int:
    try:
        if all(r is not None for *_, r in pending) and hasattr(capture, "capture_to"):
            _answer_routed(sock, capture, pending)  # the engine's own writer rank ships the rows (SGLang)
            return len(pending)
        T = max(len(t) for _, _, t, _ in pending)
        ids = torch.full((len(pending), T), pad_id, dtype=torch.long)
        attn = torch.zeros(len(pending), T, dtype=torch.long)
        for b, (_, _, t, _) in enumerate(pending):
            ids[b, : len(t)], attn[b, : len(t)] = t, 1
        out = capture(ids, attn)
    except Exception as e:  # report, keep serving
        for ident, sid, *_ in pending:
            sock.send_multipart([ident, json.dumps({"sid": sid, "error": repr(e)}).encode()])
        return len(pending)
    for b, (ident, sid, t, route) in enumerate(pending):
        n = len(t)
        if route is None:
            aux, last = out.aux[b, :n].to("cpu", dtype), out.last_hidden[b, :n].to("cpu", dtype)
            sock.send_multipart([ident, *encode_reply(sid, aux, last)], copy=False)
            continue
        rows = torch.cat((out.aux[b, :n], out.last_hidden[b, :n]), dim=1)  # raw model dtype, no wire cast
        try:
            writer().deliver(route, rows)  # this process is the writer: one copy into the ring, or a queued send
        except Exception as e:
            sock.send_multipart([ident, json.dumps({"sid": sid, "error": repr(e)}).encode()])
            continue
        sock.send_multipart([ident, routed_reply(route, rows.shape, rows.dtype)])
    return len(pending)


def routed_reply(route: Route, shape, dtype: torch.dtype) -> bytes:
    return json.dumps({"sid": route.key, "attempt": route.attempt, "via": route.kind, "rows": list(shape),
                       "dtype": str(dtype).removeprefix("torch.")}).encode()


def _answer_routed(sock, capture, pending) -> None:
    capture.capture_to([t.tolist() for _, _, t, _ in pending], [r for *_, r in pending])
    for ident, _, t, route in pending:
        sock.send_multipart([ident, routed_reply(route, (len(t), capture.row_width), capture.dtype)])


# ---- consumer side: tensor data planes ----------------------------------------------------------------------
class ShmPlane:
    """Rows land in this rank's shared-memory ring; the reply says they are there."""

    kind = "shm"

    def __init__(self, ring_bytes: int):
        self.ring = ShmRing(ring_bytes)
        self.routes: dict[tuple[int, int], Route] = {}

    def route(self, engine: int, key: int, attempt: int, nbytes: int) -> Route | None:
        r = self.ring.alloc(key, attempt, nbytes)
        if r is not None:
            self.routes[(key, attempt)] = r
        return r

    def rows(self, header: dict) -> torch.Tensor | None:
        """The rows a reply announces, read in place; None for a stale attempt (its region was given back)."""
        key = (header["sid"], header["attempt"])
        if not self.ring.holds(*key):
            return None
        dtype = DTYPES[header["dtype"]]
        n, width = header["rows"]
        return self.ring.view(self.routes[key], n * width * dtype.itemsize).view(dtype).view(n, width)

    def release(self, key: int, attempt: int, delay_s: float = 0.0) -> None:
        self.routes.pop((key, attempt), None)
        self.ring.free(key, attempt, delay_s)

    def drain(self) -> list:
        return []

    def close(self) -> None:
        self.ring.close()


class DistPlane:
    """Rows arrive over a torch.distributed pair per engine; the reply is only an acknowledgement."""

    kind = "dist"

    def __init__(self, host: str, backend: str, timeout_s: float, device: str = "cpu"):
        self.receiver = PairReceiver(host, 0, backend, timeout_s, device=device)

    def route(self, engine: int, key: int, attempt: int, nbytes: int) -> Route:
        return self.receiver.route(engine, key, attempt)

    def rows(self, header: dict) -> None:
        return None

    def release(self, key: int, attempt: int, delay_s: float = 0.0) -> None:
        pass

    def drain(self) -> list:
        return self.receiver.drain()

    def close(self) -> None:
        self.receiver.close()


# ---- consumer side -----------------------------------------------------------------------------------------
class StreamClient:
    """One trainer rank's view of the engines: ask for samples in order, get their features exactly once."""

    def __init__(self, endpoints: list[str], feature_bytes_per_token: int, credits: int = 8,
                 byte_budget: int = 1 << 30, timeout_s: float = 120.0, give_up_s: float | None = None,
                 on_silence=None, plane: ShmPlane | DistPlane | None = None, hidden_size: int | None = None):
        if not endpoints:
            raise StreamError("no engine endpoints")
        self.ctx = zmq.Context.instance()
        self.endpoints = list(endpoints)
        self.socks = [self._connect(e) for e in self.endpoints]
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.per_token = feature_bytes_per_token
        self.credits, self.byte_budget, self.timeout_s = credits, byte_budget, timeout_s
        self.give_up_s = give_up_s
        self.on_silence = on_silence  # called with the engine index when it stays silent (e.g. respawn it)
        self.queue: deque[Request] = deque()  # wanted, not yet sent
        self.inflight: dict[int, tuple[int, Request]] = {}  # sid -> (engine index, sample)
        self.plane, self.hidden_size = plane, hidden_size  # tensor data plane (rows split as [aux | last H])
        self.attempts: dict[int, int] = {}  # sid -> attempt whose rows were handed over (released later)
        self.ring_full = False
        self.ready: OrderedDict[int, Features] = OrderedDict()
        self.wanted: set[int] = set()
        self.last_heard = [time.monotonic()] * len(self.socks)
        self.ledger = Ledger()

    def _connect(self, endpoint: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        s.connect(endpoint)
        return s

    # -- bookkeeping --
    def _bytes(self, s: Request) -> int:
        return len(s.input_ids) * self.per_token

    @property
    def bytes_held(self) -> int:
        return sum(self._bytes(s) for _, s in self.inflight.values()) + sum(f.nbytes for f in self.ready.values())

    def submit(self, samples: list[Request]) -> None:
        """Requests the trainer will ask for, in order (re-submitting a wanted id is a no-op)."""
        for s in samples:
            if s.key not in self.wanted:
                self.wanted.add(s.key)
                self.queue.append(s)
        self._pump()

    def _pump(self) -> None:
        while self.queue and len(self.inflight) < self.credits:
            s = self.queue[0]
            held = self.bytes_held
            if held and held + self._bytes(s) > self.byte_budget:
                return  # over budget: wait until the trainer consumes (always allow one, or nothing moves)
            if not self._send(s):
                return  # the shm ring is full: wait until the trainer releases what it consumed
            self.queue.popleft()

    def _send(self, s: Request) -> bool:
        load = [0] * len(self.socks)
        for e, _ in self.inflight.values():
            load[e] += 1
        e = min(range(len(self.socks)), key=lambda i: (load[i], -self.last_heard[i]))
        head = {"sid": s.key, "n": len(s.input_ids)}
        if self.plane is not None:
            route = self.plane.route(e, s.key, self.ledger.sent.get(s.key, 0), self._bytes(s))
            self.ring_full = route is None
            if route is None:
                return False
            head["rid"] = route.rid
        if not any(ei == e for ei, _ in self.inflight.values()):
            self.last_heard[e] = time.monotonic()  # the timeout counts from the first outstanding request
        self.socks[e].send_multipart([json.dumps(head).encode(), torch.tensor(s.input_ids, dtype=torch.int32).numpy()])
        self.inflight[s.key] = (e, s)
        self.ledger.sent[s.key] = self.ledger.sent.get(s.key, 0) + 1
        return True

    def _receive(self, frames: list, e: int) -> None:
        self.last_heard[e] = time.monotonic()
        header = json.loads(frames[0])
        sid = header["sid"]
        if header.get("via") == "dist" and "error" not in header:
            return  # an acknowledgement: the rows come over the pair (`_arrive`)
        if sid not in self.wanted or sid in self.ready:
            self.ledger.duplicates_dropped += 1  # second reply to a re-sent request, or an id already handed over
            return
        if "error" in header:
            raise StreamError(f"engine {self.endpoints[e]} failed on request {sid}: {header['error']}")
        if header.get("via") == "shm":
            rows = self.plane.rows(header)
            if rows is None:
                self.ledger.duplicates_dropped += 1  # an attempt we re-sent: its region was given back
                return
            self._accept(sid, header["attempt"], rows)
            return
        dtype = DTYPES[header["dtype"]]
        aux = torch.frombuffer(bytearray(frames[1]), dtype=dtype).view(header["aux"])
        last = torch.frombuffer(bytearray(frames[2]), dtype=dtype).view(header["last"])
        self._ready(sid, Features(sid, aux, last))

    def _ready(self, sid: int, feats: Features) -> None:
        self.inflight.pop(sid, None)
        if any(r.key == sid for r in self.queue):  # a slow engine answered after we queued a re-send
            self.queue = deque(r for r in self.queue if r.key != sid)
        self.ready[sid] = feats

    def _accept(self, sid: int, attempt: int, rows: torch.Tensor) -> None:
        """Rows [n, (K+1)·H] from the data plane, split without a copy."""
        h = self.hidden_size
        self.attempts[sid] = attempt
        self._ready(sid, Features(sid, rows[:, :-h], rows[:, -h:]))

    def _arrive(self) -> None:
        """Rows that came over a dist pair, or the news that a pair broke (its keys are re-sent, a fresh pair made)."""
        for a in self.plane.drain():
            if a.rows is None:
                if self.plane.receiver.broken(a):
                    self._resend([sid for sid, (ei, _) in self.inflight.items() if ei == a.engine])
                continue
            if a.key not in self.wanted or a.key in self.ready:
                self.ledger.duplicates_dropped += 1
                continue
            self.last_heard[a.engine] = time.monotonic()
            self._accept(a.key, a.attempt, a.rows)

    def _resend(self, sids: list[int]) -> None:
        for sid in sids:
            _, s = self.inflight.pop(sid)
            if self.plane is not None:  # a late writer may still land in the old region: reuse it after a timeout
                self.plane.release(sid, self.ledger.sent[sid] - 1, delay_s=self.timeout_s)
            self.queue.appendleft(s)
            self.ledger.resends += 1

    def release(self, sid: int) -> None:
        """The trainer is done with the features of `sid` (a shm region returns to the ring)."""
        attempt = self.attempts.pop(sid, None)
        if attempt is not None:
            self.plane.release(sid, attempt)
            self._pump()

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for e in range(len(self.socks)):
            lost = [sid for sid, (ei, _) in self.inflight.items() if ei == e]
            if lost and now - self.last_heard[e] > self.timeout_s:
                # Engine silent: re-send its requests (the socket keeps reconnecting; a revived engine answers).
                if self.on_silence is not None:
                    self.on_silence(e)
                self._resend(lost)
                self.last_heard[e] = now

    def get(self, sid: int) -> Features:
        """Block until request `sid` (previously submitted) arrives; hand it over once."""
        if sid not in self.wanted:
            raise StreamError(f"request {sid} was never submitted")
        start = time.monotonic()
        while sid not in self.ready:
            self._pump()
            events = dict(self.poller.poll(2 if isinstance(self.plane, DistPlane) else 200))
            for e, sock in enumerate(self.socks):
                while sock in events and sock.poll(0):
                    self._receive(sock.recv_multipart(copy=True), e)
            if self.plane is not None:
                self._arrive()
                if self.ring_full and not self.inflight and sid not in self.ready and not self.plane.ring.fenced:
                    raise StreamError(f"the shm ring ({self.plane.ring.size} B) cannot hold request {sid} besides "
                                      "the features the trainer holds; raise stream.byte_budget_mb")
            self._check_timeouts()
            if self.give_up_s is not None and time.monotonic() - start > self.give_up_s:
                raise StreamError(f"no engine delivered request {sid} within {self.give_up_s:.0f}s "
                                  f"({self.endpoints})")
        feats = self.ready.pop(sid)
        self.wanted.discard(sid)
        self.ledger.delivered[sid] = self.ledger.delivered.get(sid, 0) + 1
        self._pump()
        return feats

    def pending_ids(self) -> list[int]:
        """Ids submitted but not yet handed over (saved in checkpoints as the in-flight part of the position)."""
        return sorted(self.wanted)

    def close(self) -> None:
        for s in self.socks:
            s.close()
        if self.plane is not None:
            self.plane.close()
