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
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
import zmq

from dspark_sgl.dtypes import DTYPES


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
                pending.append((ident, h["sid"], torch.frombuffer(bytearray(ids), dtype=torch.int32).long()))
            sent += _answer(sock, capture, pending, dtype, pad_id)
    finally:
        sock.close()


def _answer(sock, capture, pending, dtype, pad_id) -> int:
    T = max(len(t) for *_, t in pending)
    ids = torch.full((len(pending), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(pending), T, dtype=torch.long)
    for b, (*_, t) in enumerate(pending):
        ids[b, : len(t)], attn[b, : len(t)] = t, 1
    try:
        out = capture(ids, attn)
    except Exception as e:  # report, keep serving
        for ident, sid, _ in pending:
            sock.send_multipart([ident, json.dumps({"sid": sid, "error": repr(e)}).encode()])
        return len(pending)
    for b, (ident, sid, t) in enumerate(pending):
        n = len(t)
        aux, last = out.aux[b, :n].to("cpu", dtype), out.last_hidden[b, :n].to("cpu", dtype)
        sock.send_multipart([ident, *encode_reply(sid, aux, last)], copy=False)
    return len(pending)


# ---- consumer side -----------------------------------------------------------------------------------------
class StreamClient:
    """One trainer rank's view of the engines: ask for samples in order, get their features exactly once."""

    def __init__(self, endpoints: list[str], feature_bytes_per_token: int, credits: int = 8,
                 byte_budget: int = 1 << 30, timeout_s: float = 120.0, give_up_s: float | None = None,
                 on_silence=None):
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
            self.queue.popleft()
            self._send(s)

    def _send(self, s: Request) -> None:
        load = [0] * len(self.socks)
        for e, _ in self.inflight.values():
            load[e] += 1
        e = min(range(len(self.socks)), key=lambda i: (load[i], -self.last_heard[i]))
        if not any(ei == e for ei, _ in self.inflight.values()):
            self.last_heard[e] = time.monotonic()  # the timeout counts from the first outstanding request
        header = json.dumps({"sid": s.key, "n": len(s.input_ids)}).encode()
        self.socks[e].send_multipart([header, torch.tensor(s.input_ids, dtype=torch.int32).numpy()])
        self.inflight[s.key] = (e, s)
        self.ledger.sent[s.key] = self.ledger.sent.get(s.key, 0) + 1

    def _receive(self, frames: list, e: int) -> None:
        self.last_heard[e] = time.monotonic()
        header = json.loads(frames[0])
        sid = header["sid"]
        if sid not in self.wanted or sid in self.ready:
            self.ledger.duplicates_dropped += 1  # second reply to a re-sent request, or an id already handed over
            return
        if "error" in header:
            raise StreamError(f"engine {self.endpoints[e]} failed on request {sid}: {header['error']}")
        dtype = DTYPES[header["dtype"]]
        aux = torch.frombuffer(bytearray(frames[1]), dtype=dtype).view(header["aux"])
        last = torch.frombuffer(bytearray(frames[2]), dtype=dtype).view(header["last"])
        self.inflight.pop(sid, None)
        if any(r.key == sid for r in self.queue):  # a slow engine answered after we queued a re-send
            self.queue = deque(r for r in self.queue if r.key != sid)
        self.ready[sid] = Features(sid, aux, last)

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for e in range(len(self.socks)):
            lost = [sid for sid, (ei, _) in self.inflight.items() if ei == e]
            if lost and now - self.last_heard[e] > self.timeout_s:
                # Engine silent: re-send its requests (the socket keeps reconnecting; a revived engine answers).
                if self.on_silence is not None:
                    self.on_silence(e)
                for sid in lost:
                    _, s = self.inflight.pop(sid)
                    self.queue.appendleft(s)
                    self.ledger.resends += 1
                self.last_heard[e] = now

    def get(self, sid: int) -> Features:
        """Block until request `sid` (previously submitted) arrives; hand it over once."""
        if sid not in self.wanted:
            raise StreamError(f"request {sid} was never submitted")
        start = time.monotonic()
        while sid not in self.ready:
            self._pump()
            events = dict(self.poller.poll(200))
            for e, sock in enumerate(self.socks):
                while sock in events and sock.poll(0):
                    self._receive(sock.recv_multipart(copy=True), e)
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
