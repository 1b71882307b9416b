"""The tensor data plane of training capture (dspark_sgl.sglang.transport + training.stream planes).

Fast tests: routes in request ids, the shm ring (placement, wrap, stale writers), the SGLang row hook on stand-in
objects, and the stream with each plane against a fake engine process (the same fake as tests/test_stream.py): every
key delivered exactly once with the bytes the engine computed, also when the engine is SIGKILLed mid-stream (shm:
regions of re-sent keys are fenced; dist: the broken gloo pair is replaced and its keys re-sent)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark_sgl.sglang import transport
from dspark_sgl.sglang.transport import Route, ShmRing, TransportError, Writer, parse_rid
from tests.test_stream import K_H, H, check, requests, start_engine
from training.stream import DistPlane, ShmPlane, StreamClient, StreamError

PER_TOKEN = (K_H + H) * 4


# ---- routes -------------------------------------------------------------------------------------------------
def test_routes_travel_in_the_request_id_and_other_ids_are_untouched():
    for r in (Route("shm", 12, 1, "dspark-ring-1", 4096, 640), Route("dist", 7, 0, "10.0.0.2:41000",
                                                                       group="dspark-ab-e1-g3", backend="nccl")):
        assert parse_rid(r.rid) == r
    assert parse_rid("b4c2e0a1") is None and parse_rid(None) is None
    with pytest.raises(TransportError, match="malformed capture request id"):
        parse_rid("dspark-cap|shm|x|0|ring|0|64")


# ---- the ring -------------------------------------------------------------------------------------------------
def test_ring_places_in_order_wraps_and_reuses_only_what_was_consumed():
    ring = ShmRing(1024)
    try:
        a, b, c = (ring.alloc(k, 0, 240) for k in range(3))  # 256-byte regions with their stamps
        assert [r.offset for r in (a, b, c)] == [0, 256, 512]
        assert ring.alloc(3, 0, 240).offset == 768 and ring.alloc(4, 0, 240) is None  # full
        ring.free(1, 0)
        assert ring.alloc(4, 0, 240) is None, "a region behind an unconsumed one was reused"
        ring.free(0, 0)
        assert ring.alloc(4, 0, 240).offset == 0  # wrapped onto the consumed ones
        with pytest.raises(TransportError, match="does not fit the 1024-byte shm ring"):
            ring.alloc(9, 0, 2000)
    finally:
        ring.close()


def test_writer_lands_raw_bytes_in_place_and_skips_a_region_given_back():
    ring, w = ShmRing(1 << 14), Writer()
    try:
        rows = torch.randn(5, 9).bfloat16()
        r = ring.alloc(7, 0, rows.numel() * 2)
        assert w.deliver(r, rows)
        got = ring.view(r, rows.numel() * 2).view(torch.bfloat16).view(5, 9)
        assert torch.equal(got.view(torch.int16), rows.view(torch.int16))  # bytes, not values
        assert got.untyped_storage().data_ptr() == ring.buf.untyped_storage().data_ptr()  # read in place
        ring.free(7, 0, delay_s=60)  # re-sent: the stamp is cleared at once, the space is fenced
        assert not w.deliver(r, torch.zeros(5, 9).bfloat16()), "a stale writer overwrote a region"
        assert ring.alloc(8, 0, 16 * 1024 - 64) is None, "a fenced region was reused before its delay"
        with pytest.raises(TransportError, match="exceeds its"):
            w.deliver(ring.alloc(9, 0, 8), rows)
    finally:
        ring.close()


# ---- the SGLang hook (stand-in objects, no SGLang) -------------------------------------------------------------
class FakeMode:
    def is_full(self):
        return True


def test_row_hook_ships_tagged_rows_on_the_writer_rank_and_leaves_other_requests_alone(monkeypatch):
    from dspark_sgl.sglang import capture

    shipped, calls = [], []
    monkeypatch.setattr(transport, "writer", lambda: SimpleNamespace(deliver=lambda r, x: shipped.append((r, x))))
    monkeypatch.setattr(capture, "is_writer_rank", lambda: True)
    original = lambda sched, **kw: calls.append(kw) or kw["hidden_state_offset"] + kw["extend_input_len"]
    rows = torch.arange(40.0).view(10, 4)
    out = SimpleNamespace(hidden_states=rows)
    route = Route("shm", 3, 0, "ring", 0, 4096)
    tagged = SimpleNamespace(rid=route.rid, return_hidden_states=True, hidden_states=[])
    plain = SimpleNamespace(rid="abc", return_hidden_states=True, hidden_states=[])
    kw = dict(logits_output=out, capture_hidden_mode=FakeMode(), store=True)
    assert capture._rows_around(original, None, req=plain, hidden_state_offset=0, extend_input_len=4, **kw) == 4
    assert capture._rows_around(original, None, req=tagged, hidden_state_offset=4, extend_input_len=6, **kw) == 10
    assert len(calls) == 1 and calls[0]["req"] is plain  # SGLang's own code ran for the plain request only
    assert shipped[0][0] == route and torch.equal(shipped[0][1], rows[4:10]) and tagged.hidden_states == []
    monkeypatch.setattr(capture, "is_writer_rank", lambda: False)  # other TP ranks hold the rows too: ship once
    capture._rows_around(original, None, req=tagged, hidden_state_offset=4, extend_input_len=6, **kw)
    assert len(shipped) == 1


# ---- the stream over each plane ----------------------------------------------------------------------------------
@pytest.fixture
def endpoint(tmp_path):
    return f"ipc://{tmp_path}/engine.sock"


def make_plane(kind: str, timeout_s: float):
    return ShmPlane(1 << 20) if kind == "shm" else DistPlane("127.0.0.1", "gloo", timeout_s)


TIMEOUT = {"shm": 1.5, "dist": 15.0}  # a dead gloo peer is seen at once; the pair must outlast an engine start


@pytest.mark.parametrize("kind", ["shm", "dist"])
def test_plane_delivers_every_key_once_with_the_engines_bytes(endpoint, kind):
    engine = start_engine(endpoint)
    client = StreamClient([endpoint], PER_TOKEN, credits=4, timeout_s=30, give_up_s=60,
                          plane=make_plane(kind, 30), hidden_size=H)
    reqs = requests(20)
    try:
        client.submit(reqs)
        for r in reqs:
            f = client.get(r.key)
            check(f, r)  # exact float32 values of the fake engine (token*1000 + position)
            client.release(r.key)
    finally:
        client.close()
        engine.kill()
    assert client.ledger.delivered == {r.key: 1 for r in reqs} and client.ledger.resends == 0


@pytest.mark.parametrize("kind", ["shm", "dist"])
def test_plane_engine_killed_mid_stream_nothing_lost_nothing_twice(endpoint, kind):
    engine = start_engine(endpoint, delay=0.3)  # each batch takes 0.3 s, so the kill lands inside one
    client = StreamClient([endpoint], PER_TOKEN, credits=6, timeout_s=TIMEOUT[kind], give_up_s=90,
                          plane=make_plane(kind, TIMEOUT[kind]), hidden_size=H)
    reqs = requests(30)
    try:
        client.submit(reqs)
        for r in reqs[:10]:
            check(client.get(r.key), r)
            client.release(r.key)
        engine.kill()
        engine.join()
        time.sleep(0.5)
        engine = start_engine(endpoint)
        for r in reqs[10:]:
            check(client.get(r.key), r)
            client.release(r.key)
    finally:
        client.close()
        engine.kill()
    assert client.ledger.delivered == {r.key: 1 for r in reqs}, "a sample was lost or delivered twice"
    assert client.ledger.resends > 0, "the kill did not hit in-flight requests"
    if kind == "dist":
        assert client.plane.receiver.generations[0] >= 1, "the broken pair was not replaced"


def test_ring_too_small_for_what_the_trainer_holds_is_one_error(endpoint):
    engine = start_engine(endpoint)
    reqs = requests(4)
    ring = ShmRing.region_bytes(max(len(r.input_ids) for r in reqs) * PER_TOKEN) + 64
    client = StreamClient([endpoint], PER_TOKEN, credits=4, timeout_s=30, give_up_s=30,
                          plane=ShmPlane(ring), hidden_size=H)
    try:
        client.submit(reqs)
        client.get(0)  # held, not released
        with pytest.raises(StreamError, match="shm ring .* cannot hold request 1"):
            client.get(1)
    finally:
        client.close()
        engine.kill()


# ---- the recipe ------------------------------------------------------------------------------------------------
def test_recipe_transport_section_and_the_k3_topology():
    from training.recipe import RecipeError, load_recipe

    k3 = load_recipe(str(Path(__file__).resolve().parents[1] / "configs" / "kimi-k3-dspark.yaml"))
    assert (k3.transport.kind, k3.transport.backend) == ("dist", "nccl")
    assert (k3.engine.replicas, k3.engine.tp_size, len(k3.engine.endpoints)) == (2, 8, 2)
    assert (k3.train.world_size, k3.train.global_batch, k3.train.reshard_after_forward) == (16, 512, False)
    with pytest.raises(RecipeError, match=re.escape("transport.kind: Input should be 'zmq', 'shm' or 'dist'")):
        load_recipe(None, ["transport.kind=rdma"])
    with pytest.raises(RecipeError, match="transport.kind=shm moves rows from an engine process"):
        load_recipe(None, ["transport.kind=shm"])
    with pytest.raises(RecipeError, match="engine.replicas=2 but 1 engine.endpoints"):
        load_recipe(None, ["engine.placement=disaggregated", "engine.endpoints=[tcp://a:1]", "engine.replicas=2"])
