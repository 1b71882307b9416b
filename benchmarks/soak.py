"""Soak: a seeded mix of requests against one DSPARK server (`dspark serve`, CPU) at concurrency up to 16, with
cancellations, refusals and two live draft swaps under load; nothing may be lost, leaked or changed.

The mix (every request native /generate on token ids): greedy and sampled, penalties, min-p, per-request seeds, stop
strings, n = 2, short and long max_new_tokens, streamed and not; ~10 % streamed and cancelled after the first event
(the client disconnects); ~5 % prompts longer than the context (a clear 4xx); ~2 % with custom_logit_processor (400
on DSPARK). A third of the way in the trainer's publish call (training.publish.push) swaps in a good draft, two thirds
in a bad one (its weights file truncated: 400, the good one keeps serving).

Must hold: every non-cancelled request completes (200 with its tokens, or the 4xx it must get); zero 5xx; every
greedy request's tokens equal a plain server's (`dspark serve --no-draft --disable-overlap-schedule`, started after
the DSPARK server has stopped, so the two never share the 2 cores); after the load drains and the radix cache is
flushed, SGLang's free KV token count and free request slots (through which our draft context is indexed; the
worker's `pools` entry in /server_info) are back at their idle values; the server's RSS grew < 5 % from the first to
the last third of the run.

    python benchmarks/soak.py [--minutes 2] [--requests N] [--concurrency 16] [--seed 0]

Prints one summary line and writes benchmarks/results/soak.json. tests/test_sglang_soak.py runs a shorter one.
"""

from __future__ import annotations

import http.client
import json
import random
import shutil
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from dspark_sgl.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sglang_cpu"))
from dspark_testkit import ServeCommand, build_bigram_draft  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "soak.json"
PLAIN_ARGS = ["--no-draft", "--disable-overlap-schedule"]  # the reference: plain decoding, no overlap scheduling
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little", "1, 2, 3, 4, 5, 6,",
    "List three primary colors: red,", "Water boils at a temperature of", "import numpy as np\n\ndef mean(xs):",
    "Monday, Tuesday, Wednesday,", "Q: What is 12 plus 7?\nA:", "The three branches of the US government are",
    "for i in range(10):\n    print(", "To make a cup of tea, first", "SELECT name, age FROM users WHERE",
    "The largest planet in our solar system is", "Dear John,\nThank you for your letter.", "In 1969, Neil Armstrong",
]
KINDS = [  # (kind, weight): the seeded mix
    ("greedy", 30), ("greedy-stop", 8), ("sampled", 12), ("penalties", 8), ("min-p", 6), ("seeded", 8), ("n2", 6),
    ("cancel", 10), ("too-long", 5), ("logit-processor", 2),
]
STOPS = [[","], ["\n"], [".", "!"], ["the"]]


@dataclass
class Spec:
    """One request of the mix."""

    i: int
    kind: str
    body: dict
    stream: bool
    expect: str  # "ok", "4xx" or "cancel"

    @property
    def greedy(self) -> bool:
        return self.kind.startswith("greedy")


@dataclass
class Outcome:
    i: int
    kind: str
    expect: str
    status: int | None
    completed: bool  # ok: 200 with a finish reason; 4xx: the 4xx with a message; cancel: disconnected
    ids: list[int] | None = None  # greedy requests' tokens
    error: str = ""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


SHORT, LONG = (1, 4, 8, 16), (48, 96)  # max_new_tokens: 70 % short, 30 % long


def request_mix(seed: int, prompts: list[list[int]], context_len: int, vocab: int, long: tuple = LONG):
    """An endless seeded stream of Specs."""
    rng = random.Random(seed)
    names, weights = zip(*KINDS, strict=True)
    i = 0
    while True:
        kind = rng.choices(names, weights)[0]
        ids = rng.choice(prompts)
        params = {"max_new_tokens": rng.choice(SHORT) if rng.random() < 0.7 else rng.choice(long)}
        expect, stream = "ok", rng.random() < 0.4
        extra = {}
        if kind.startswith("greedy"):
            params["temperature"] = 0.0
            if kind == "greedy-stop":
                params["stop"] = rng.choice(STOPS)
        else:
            params |= {"temperature": rng.choice([0.6, 0.8, 1.0]), "top_p": rng.choice([0.9, 1.0]),
                       "top_k": rng.choice([-1, 20])}
        if kind == "penalties":
            params |= {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1}
        elif kind == "min-p":
            params["min_p"] = rng.choice([0.05, 0.1])
        elif kind == "seeded":
            params["sampling_seed"] = rng.randrange(1000)
        elif kind == "n2":
            params["n"], stream = 2, False
        elif kind == "cancel":
            params["max_new_tokens"], stream, expect = max(long), True, "cancel"
        elif kind == "too-long":
            ids = [rng.randrange(vocab) for _ in range(context_len + rng.randint(1, 64))]
            expect, stream = "4xx", False  # streamed, SGLang's refusal is an error event after a 200
        elif kind == "logit-processor":
            extra["custom_logit_processor"] = "{}"
            expect, stream = "4xx", False
        yield Spec(i, kind, {"input_ids": ids, "sampling_params": params, "stream": stream, **extra}, stream, expect)
        i += 1


def send(url: str, spec: Spec, timeout: float) -> Outcome:
    """One request; a `cancel` spec reads the first streamed event and then drops the connection."""
    t0 = time.perf_counter()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/generate", json.dumps(spec.body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            message = r.read().decode(errors="replace")
            return Outcome(spec.i, spec.kind, spec.expect, r.status, spec.expect == "4xx" and 400 <= r.status < 500
                           and bool(message.strip()), error=message[:300], wall_s=time.perf_counter() - t0)
        if spec.stream:
            return _read_stream(spec, r, t0)
        out = json.loads(r.read())
        outs = out if isinstance(out, list) else [out]
        done = all(o.get("meta_info", {}).get("finish_reason") for o in outs)
        return Outcome(spec.i, spec.kind, spec.expect, 200, done and spec.expect == "ok",
                       ids=outs[0]["output_ids"] if spec.greedy else None, wall_s=time.perf_counter() - t0)
    except Exception as e:  # no answer within the timeout, or the server went away
        return Outcome(spec.i, spec.kind, spec.expect, None, False, error=repr(e), wall_s=time.perf_counter() - t0)
    finally:
        conn.close()


def _read_stream(spec: Spec, r, t0: float) -> Outcome:
    events = []
    for line in r:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        events.append(json.loads(data))
        if spec.expect == "cancel":  # the client disconnects mid-stream (finally: conn.close())
            return Outcome(spec.i, spec.kind, spec.expect, 200, True, wall_s=time.perf_counter() - t0)
    errors = [e["error"] for e in events if "error" in e]
    if errors or not events:
        return Outcome(spec.i, spec.kind, spec.expect, 200, False, error=str(errors or "no events")[:300],
                       wall_s=time.perf_counter() - t0)
    last = events[-1]
    meta = last.get("meta_info", {})
    ids = last["output_ids"]
    if len(ids) != meta.get("completion_tokens", len(ids)):  # incremental streaming: the chunks add up
        ids = [t for e in events for t in e["output_ids"]]
    return Outcome(spec.i, spec.kind, spec.expect, 200, bool(meta.get("finish_reason")) and spec.expect == "ok",
                   ids=ids if spec.greedy else None, wall_s=time.perf_counter() - t0)


def server_pids(server: ServeCommand) -> list[int]:
    import psutil

    root = psutil.Process(server.proc.pid)
    return [root.pid, *(c.pid for c in root.children(recursive=True))]


def rss_mb(pids: list[int]) -> float:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def pools(server: ServeCommand) -> dict:
    """The worker's pool counts (dspark_info_record.pools), after the radix cache is flushed."""
    server.post("/flush_cache", {})
    return server.get("/server_info")["internal_states"][0]["dspark_info_record"]["pools"]


def draft_record(server: ServeCommand) -> dict:
    return server.get("/server_info")["internal_states"][0]["dspark_info_record"]["draft_update"]


def make_drafts(target: Path, prompt_ids: list[list[int]], root: Path, draft: Path | None) -> dict[str, Path]:
    """The served draft, a good replacement (another bigram draft, release "good") and a bad one (truncated)."""
    from dspark_sgl.sglang.weights import RELEASE_FILE

    first = draft or build_bigram_draft(target, prompt_ids, root / "first")
    good = build_bigram_draft(target, prompt_ids[::-1], root / "good", seed=1)
    (good / RELEASE_FILE).write_text(json.dumps({"version": "good", "step": 1}) + "\n")
    bad = root / "bad"
    shutil.copytree(good, bad)
    (bad / RELEASE_FILE).write_text(json.dumps({"version": "bad", "step": 2}) + "\n")
    weights = next(bad.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return {"first": first, "good": good, "bad": bad}


def run_load(server: ServeCommand, specs, concurrency: int, seconds: float, max_requests: int | None,
             swaps: list[tuple[float, Path]], timeout: float = 600.0) -> dict:
    """Drive the mix until `seconds` pass or `max_requests` are sent; push each swap's draft when that fraction of
    the run is done. Returns outcomes, swap answers and RSS samples."""
    from training.publish import push

    lock = threading.Lock()
    sent, outcomes, samples = [0], [], []
    t0 = time.perf_counter()
    stop = threading.Event()

    def progress() -> float:
        by_time = (time.perf_counter() - t0) / seconds
        return max(by_time, sent[0] / max_requests) if max_requests else by_time

    def worker() -> None:
        while True:
            with lock:
                if progress() >= 1.0:
                    return
                spec = next(specs)
                sent[0] += 1
            out = send(server.url, spec, timeout)
            with lock:
                outcomes.append(out)

    def watcher() -> None:
        pids, todo = server_pids(server), list(swaps)
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, rss_mb(pids)))
            if todo and progress() >= todo[0][0]:
                frac, folder = todo.pop(0)
                answers.append({"at": frac, "draft": folder.name, **push(server.url, folder, timeout=120)})
            stop.wait(1.0)

    answers: list[dict] = []
    watch = threading.Thread(target=watcher, daemon=True)
    watch.start()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    stop.set()
    watch.join()
    return {"outcomes": sorted(outcomes, key=lambda o: o.i), "swaps": answers, "rss": samples,
            "wall_s": time.perf_counter() - t0}


def greedy_reference(server: ServeCommand, specs: list[Spec], concurrency: int = 4) -> dict[int, list[int]]:
    """The plain server's tokens for each greedy spec (same body, not streamed)."""
    def one(spec: Spec) -> tuple[int, list[int]]:
        body = {**spec.body, "stream": False}
        return spec.i, server.post("/generate", body)["output_ids"]

    with ThreadPoolExecutor(concurrency) as pool:
        return dict(pool.map(one, specs))


def rss_growth(samples: list[tuple[float, float]]) -> float:
    """Mean RSS of the last third of the run over the first third, minus 1."""
    k = max(len(samples) // 3, 1)
    first, last = [s for _, s in samples[:k]], [s for _, s in samples[-k:]]
    return (sum(last) / len(last)) / (sum(first) / len(first)) - 1


def soak(target: Path, prompt_ids: list[list[int]], workdir: Path, seconds: float = 120.0,
         max_requests: int | None = None, concurrency: int = 16, seed: int = 0, draft: Path | None = None,
         during=None, port: int | None = None, long: tuple = LONG) -> dict:
    """The whole soak: DSPARK server under the mix, then the plain reference. `during(server)` runs on the DSPARK
    server after the load (e.g. the HTTP fuzz), before the idle pools are read again. `port`: the DSPARK server's
    (the plain one gets the next), else free ones."""
    ports = [{"port": port}, {"port": port + 1}] if port else [{}, {}]
    drafts = make_drafts(target, prompt_ids, workdir, draft)
    context_len = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    specs_seen: list[Spec] = []

    def recorded(gen):
        for spec in gen:
            specs_seen.append(spec)
            yield spec

    with ServeCommand(target, serve_args=["--draft", str(drafts["first"])], **ports[0]) as server:
        server.generate(prompt_ids[:2], 4)  # warm-up
        idle = pools(server)
        load = run_load(server, recorded(request_mix(seed, prompt_ids, context_len, vocab, long)), concurrency, seconds,
                        max_requests, [(1 / 3, drafts["good"]), (2 / 3, drafts["bad"])])
        extra = during(server) if during else None
        drained = pools(server)
        record = draft_record(server)
        alive = server.proc.poll() is None
        log_tail = server.log()[-3000:]
    greedy = [s for s in specs_seen if s.greedy and any(o.i == s.i and o.ids is not None for o in load["outcomes"])]
    with ServeCommand(target, serve_args=PLAIN_ARGS, **ports[1]) as plain:
        reference = greedy_reference(plain, greedy)
    return summarise(load, reference, idle, drained, record, alive, extra) | {"log_tail": log_tail if not alive
                                                                                 else ""}


def summarise(load: dict, reference: dict[int, list[int]], idle: dict, drained: dict, record: dict, alive: bool,
              extra) -> dict:
    outs: list[Outcome] = load["outcomes"]
    by_status = dict(sorted(Counter(str(o.status) for o in outs).items()))
    by_kind = dict(sorted(Counter(o.kind for o in outs).items()))
    lost = [o for o in outs if not o.completed]
    greedy = [o for o in outs if o.ids is not None and o.i in reference]
    differ = [o.i for o in greedy if o.ids != reference[o.i]]
    swaps = [(s["draft"], s["status"]) for s in load["swaps"]]
    growth = rss_growth(load["rss"])
    return {
        "requests": len(outs), "wall_s": round(load["wall_s"], 1), "by_status": by_status, "by_kind": by_kind,
        "cancelled": sum(o.expect == "cancel" for o in outs), "not_completed": [o.__dict__ for o in lost[:20]],
        "not_completed_count": len(lost), "five_xx": sum(o.status is not None and o.status >= 500 for o in outs),
        "greedy_checked": len(greedy), "greedy_equal": len(greedy) - len(differ), "greedy_differ": differ[:20],
        "swaps": load["swaps"], "swap_statuses": swaps, "draft_record": record,
        "pools_idle": idle, "pools_drained": drained, "rss_mb_first_last": [load["rss"][0][1], load["rss"][-1][1]]
        if load["rss"] else None, "rss_growth": round(growth, 4), "server_alive": alive, "during": extra,
    }


def holds(s: dict) -> list[str]:
    """What the soak must hold; each broken rule named (empty: all hold)."""
    broken = []
    if s["not_completed_count"]:
        broken.append(f"{s['not_completed_count']} requests did not complete")
    if s["five_xx"]:
        broken.append(f"{s['five_xx']} 5xx")
    if s["greedy_equal"] != s["greedy_checked"]:
        broken.append(f"greedy differs from plain: {s['greedy_differ']}")
    if s["swap_statuses"] != [("good", 200), ("bad", 400)]:
        broken.append(f"swaps: {s['swap_statuses']}")
    if s["draft_record"].get("version") != "good":
        broken.append(f"the good draft is not serving after the bad push: {s['draft_record']}")
    for key in ("kv_free_tokens", "req_slots_free"):
        if s["pools_drained"][key] != s["pools_idle"][key]:
            broken.append(f"{key}: idle {s['pools_idle'][key]}, drained {s['pools_drained'][key]}")
    if s["rss_growth"] >= 0.05:
        broken.append(f"RSS grew {s['rss_growth']:.1%}")
    if not s["server_alive"]:
        broken.append("the server died")
    return broken


def summary_line(s: dict) -> str:
    p0, p1 = s["pools_idle"], s["pools_drained"]
    return (f"soak: {s['requests']} requests in {s['wall_s']:.0f} s, status {s['by_status']}, cancelled "
            f"{s['cancelled']}, not completed {s['not_completed_count']}, 5xx {s['five_xx']}, greedy = plain "
            f"{s['greedy_equal']}/{s['greedy_checked']}, swaps {s['swap_statuses']}, KV free "
            f"{p0['kv_free_tokens']}->{p1['kv_free_tokens']}, request slots {p0['req_slots_free']}->"
            f"{p1['req_slots_free']}, RSS {s['rss_growth']:+.1%}")


def main(
    minutes: Annotated[float, typer.Option(help="how long the load runs")] = 2.0,
    requests: Annotated[int | None, typer.Option(help="stop after this many requests instead")] = None,
    concurrency: int = 16,
    seed: int = 0,
    draft: Annotated[Path | None, typer.Option(help="the served draft (default: an oracle bigram draft)")] = None,
    port: Annotated[int, typer.Option(help="the DSPARK server's port, the plain one's is next (0: free ones)")] = 0,
    out: Path = RESULT,
) -> None:
    import tempfile

    from transformers import AutoTokenizer

    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    target = Path(smollm2_hf_dir())
    tok = AutoTokenizer.from_pretrained(target)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        s = soak(target, prompt_ids, Path(tmp), minutes * 60, requests, concurrency, seed, draft, port=port or None)
    line = summary_line(s)
    broken = holds(s)
    print(line)
    for b in broken:
        print(f"  BROKEN: {b}")
    record = provenance(minutes=minutes, requests=requests, concurrency=concurrency, seed=seed,
                        draft=str(draft) if draft else "bigram (oracle, built from the prompts)", mix=KINDS,
                        plain_args=PLAIN_ARGS) | {"summary": line, "broken": broken, **s}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    if broken:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
