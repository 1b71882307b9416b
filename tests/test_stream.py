"""Streaming engines -> trainer: credits and byte budget hold, every request is delivered exactly once with the right
features, also when the engine is SIGKILLed mid-stream and comes back, or is so slow that requests are re-sent."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from training.stream import Request, StreamClient, StreamError, serve

K_H, H = 6, 3  # aux width (K·H) and hidden size of the fake engine


def fake_capture(ids: torch.Tensor, attn: torch.Tensor, delay: float = 0.0, fail: bool = False):
    """Features that are a known function of (token, position), so the consumer can check what it got."""
    if fail:
        raise RuntimeError("target exploded")
    time.sleep(delay)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    base = (ids * 1000 + pos).float()[..., None]
    return SimpleNamespace(aux=base.expand(*ids.shape, K_H).clone(), last_hidden=-base.expand(*ids.shape, H).clone())


def expected(ids: list[int]) -> torch.Tensor:
    return torch.tensor([t * 1000 + p for p, t in enumerate(ids)], dtype=torch.float32)


def _engine(bind: str, delay: float, fail: bool) -> None:
    serve(lambda i, a: fake_capture(i, a, delay, fail), bind, max_batch=4, wire_dtype="float32")


def wait_bound(*paths: Path, timeout_s: float = 60.0) -> None:
    """Until every engine has bound its ipc:// endpoint (zmq creates the socket file at bind)."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"engines never bound: {[p for p in paths if not p.exists()]}"
        time.sleep(0.01)


def start_engine(bind: str, delay: float = 0.0, fail: bool = False) -> mp.Process:
    p = mp.get_context("spawn").Process(target=_engine, args=(bind, delay, fail), daemon=True)
    p.start()
    return p


def requests(n: int) -> list[Request]:
    g = torch.Generator().manual_seed(0)
    return [Request(k, torch.randint(1, 50, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist())
            for k in range(n)]


def check(feats, req: Request) -> None:
    assert feats.sid == req.key
    torch.testing.assert_close(feats.aux[:, 0], expected(req.input_ids))
    torch.testing.assert_close(feats.last[:, 0], -expected(req.input_ids))


@pytest.fixture
def endpoint(tmp_path):
    return f"ipc://{tmp_path}/engine.sock"


def test_credits_and_byte_budget_bound_what_is_in_flight(endpoint):
    engine = start_engine(endpoint)
    per_token = (K_H + H) * 4
    budget = 30 * per_token  # about three samples
    client = StreamClient([endpoint], per_token, credits=4, byte_budget=budget, timeout_s=30)
    seen = []
    send = client._send

    def spy(req):
        seen.append((len(client.inflight) + 1, client.bytes_held, client._bytes(req)))
        send(req)

    client._send = spy
    reqs = requests(25)
    try:
        client.submit(reqs)
        for r in reqs:
            check(client.get(r.key), r)
    finally:
        client.close()
        engine.kill()
    assert max(n for n, _, _ in seen) <= 4
    # over budget only ever when nothing else is held (one request must always be allowed to move)
    assert all(held == 0 or held + new <= budget for _, held, new in seen)
    assert any(n < 4 for n, _, _ in seen[4:]), "the byte budget never limited the credits"
    assert client.ledger.delivered == {r.key: 1 for r in reqs}


def test_engine_killed_mid_stream_nothing_lost_nothing_twice(endpoint):
    engine = start_engine(endpoint, delay=0.3)  # each batch takes 0.3 s, so the kill lands inside one
    client = StreamClient([endpoint], (K_H + H) * 4, credits=6, byte_budget=1 << 20, timeout_s=1.0, give_up_s=60)
    reqs = requests(30)
    try:
        client.submit(reqs)
        for r in reqs[:10]:
            check(client.get(r.key), r)
        engine.kill()  # SIGKILL: requests in its queue die with it
        engine.join()
        time.sleep(0.5)
        engine = start_engine(endpoint)
        for r in reqs[10:]:
            check(client.get(r.key), r)
    finally:
        client.close()
        engine.kill()
    assert client.ledger.delivered == {r.key: 1 for r in reqs}, "a sample was lost or delivered twice"
    assert client.ledger.resends > 0, "the kill did not hit in-flight requests"


def test_slow_engine_resends_are_deduplicated(tmp_path):
    slow, fast = f"ipc://{tmp_path}/slow.sock", f"ipc://{tmp_path}/fast.sock"
    engines = [start_engine(slow, delay=1.5), start_engine(fast)]
    wait_bound(tmp_path / "slow.sock", tmp_path / "fast.sock")  # both up before the first request: no sleep
    client = StreamClient([slow, fast], (K_H + H) * 4, credits=8, byte_budget=1 << 20, timeout_s=0.3, give_up_s=60)
    reqs = requests(16)
    try:
        client.submit(reqs)
        for r in reqs:
            check(client.get(r.key), r)
        deadline = time.time() + 30  # let the slow engine's late answers arrive (a loaded box is slow)
        while client.ledger.duplicates_dropped == 0 and time.time() < deadline:
            events = dict(client.poller.poll(100))
            for e, sock in enumerate(client.socks):
                while sock in events and sock.poll(0):
                    client._receive(sock.recv_multipart(), e)
    finally:
        client.close()
        for e in engines:
            e.kill()
    assert client.ledger.delivered == {r.key: 1 for r in reqs}
    assert client.ledger.resends > 0 and client.ledger.duplicates_dropped > 0


def test_engine_error_is_reported(endpoint):
    engine = start_engine(endpoint, fail=True)
    client = StreamClient([endpoint], 4, timeout_s=30, give_up_s=30)
    try:
        client.submit(requests(1))
        with pytest.raises(StreamError, match="target exploded"):
            client.get(0)
    finally:
        client.close()
        engine.kill()


def test_unsubmitted_request_is_an_error(endpoint):
    client = StreamClient([endpoint], 4)
    with pytest.raises(StreamError, match="never submitted"):
        client.get(3)
    client.close()
