"""Planted bugs, for TESTS ONLY: prove that the test suite can fail.

`DSPARK_SGL_PLANT=<name>` (read once, when this module is first imported: by the SGLang server's worker at start,
or by a test process) switches on ONE known bug at its one site in the serving worker or the reference engine; the
tests marked `planted` (tests/test_faults.py, tests/test_sglang_planted.py) show that the check meant to catch it
fails under it and passes without it. In-process tests use the `plant(name)` context manager instead.

Never set it in production: every planted bug breaks losslessness, acceptance or seeding. Unset (the default), each
site costs one module-level boolean test (`planted(name)` compares a string with None).

The sites (docs/testing.md has the table of which test catches which):
    verify_limit    - the verify limit is `lengths - 2`, not `lengths - 1`: the last scheduled draft is never accepted
                      (worker._forward_decode; engine._spec_step with a planner)
    hybrid_commit   - a hybrid target's recurrent state is committed for c + 2 tokens, not c + 1 (worker)
    hybrid_state    - after each commit, a hybrid target's recurrent state (SSM state, conv window) of the batch's
                      requests is zeroed: shows the served output depends on that state (sglang/hybrid.py)
    context_keep    - the draft-context keep mask is shifted by one column: the anchor's context is not written,
                      the first rejected draft's is (worker; engine: the context is taken one column late)
    stale_cap       - requests whose draft context predates a live swap are not capped to the anchor (worker)
    d2t_sampled     - a sampled reduced-vocabulary draft maps draft id i to target id vocab[i + 1] (markov.rollout,
                      shared by both)
    markov_prev     - the Markov head's previous token is the anchor at every step (markov.rollout)
    kv_rollback     - the target KV of rejected drafts is kept (engine: TargetKV.commit skipped; SGLang's own
                      allocator frees the worker's, so the worker has no such site)
    penalty_drafts  - penalties at verify column j count the output history but not the block's drafts x_1..x_j
                      (target_dist.adjust_logits, shared)
    match_residual  - a rejected match proposal's bonus is drawn from p, not from p without the rejected token x (the
                      residual of a one-hot q): rows.accept_rows, shared; speculative/match.py's hybrid
    top_p_boundary  - top-p drops the token that crosses the boundary (mass before it <= p, but with it > p)
                      (target_dist._filter, shared)
    seed            - a request's sampling_seed is ignored: seeded rows read the step's generator (rows.step_noise)
    rank_sync       - under TP, rank 0's drafts, verify lengths, accepted counts and bonus tokens are not broadcast:
                      each rank keeps its own decisions (sglang/ranks.py RankSync.share), and the worker's draft on
                      ranks 1+ gets other weights (a rank that drafts with another seed; worker.__init__)
    rank_agree      - under TP, a live draft update is not agreed across ranks: each rank swaps or refuses on its own
                      verdict (sglang/ranks.py RankSync.agree)
    cost_no_draft   - the full-cost rule prices a speculative step without the draft's cost, so it speculates where
                      that cannot pay (speculative/scheduler.py CostTable.spec_seconds, shared)
    anchor_last     - with anchor_state, the reference context cache keeps the context vector of the token before
                      the last committed one, so inference reads ctx[a-2] where training read ctx[a-1]
                      (model/draft.py DraftContextCache.append)
    accept_per_step - the full-cost rule's acceptance counts forget per step, not per row: a batch of 16 keeps the
                      previous traffic's rate 16x longer (scheduler.AcceptStats.record, shared)
    decide_peek     - the full-cost rule turns speculation off after drafting when this step's own survivals say it
                      does not pay: whether x_1 is verified then depends on x_1 (scheduler.FullCostRule.widths, shared)
    forced_typical  - steps the operator forced (the start-up profile's arms) count as served steps, whose median
                      bounds the rule's steps (scheduler.BucketCosts.add_step, shared)
    warmup_priced   - the first sample a process times of each cost cell in a bucket (off, draft, after at a width:
                      its one-off warm-up) prices that cell like any other (scheduler.CostTable._warm, shared)
    cold_wide       - a bucket with no costs verifies the whole window in the rule's steps, at any batch (a batch of 32:
                      256 columns on a guess; scheduler.FullCostRule.cold_width, shared)
    grammar_mask    - the worker leaves the target's verify logits unmasked by the requests' grammars
                      (sglang/worker._grammar_mask)
    export_transpose - the export writes layer 0's o_proj transposed (square: every loader takes it)
                      (model/formats.export_state_dict)
    export_d2t      - the export maps the last draft id one target id too far (model/formats.export_state_dict)

Planted crashes, the same way: `DSPARK_SGL_CRASH=<site>[:<key>]` makes the process SIGKILL itself at that site (with
a key, only where the site's key matches), leaving whatever a `kill -9` at the worst moment would leave. The fault
tests (tests/test_sglang_faults.py) check that nothing is lost or left stuck after it:
    publish_paused  - the trainer's publish (training.publish.push), with the server paused for the swap and the update
                      not yet sent
    traffic_write   - the server's traffic recorder (sglang/traffic.py), with half of one record's line written and
                      flushed; key: the request id (rid) whose record tears
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import NoReturn

ENV = "DSPARK_SGL_PLANT"
PLANTS = frozenset({
    "verify_limit", "hybrid_commit", "hybrid_state", "context_keep", "stale_cap", "d2t_sampled", "markov_prev",
    "kv_rollback", "penalty_drafts", "top_p_boundary", "match_residual", "seed", "rank_sync", "rank_agree",
    "cost_no_draft", "decide_peek", "export_transpose", "export_d2t", "match_step_stats", "grammar_mask",
    "anchor_last", "accept_per_step", "match_rows_stats", "match_blind_decide", "cost_unordered",
    "request_blind", "step_uncapped", "accept_cold", "forced_typical", "warmup_priced", "cold_wide",
})


def _check(name: str | None) -> str | None:
    if name is not None and name not in PLANTS:
        raise ValueError(f"{ENV}={name!r} is not a known planted bug; known: {', '.join(sorted(PLANTS))}")
    return name


_active: str | None = _check(os.environ.get(ENV) or None)


def planted(name: str) -> bool:
    """Whether the planted bug `name` is switched on (always False outside tests)."""
    return _active == name


@contextmanager
def plant(name: str | None):
    """Switch on planted bug `name` (None: none) for the body; in-process tests only."""
    global _active
    saved, _active = _active, _check(name)
    try:
        yield
    finally:
        _active = saved


CRASH_ENV = "DSPARK_SGL_CRASH"
CRASHES = frozenset({"publish_paused", "traffic_write"})


def _crash_spec(value: str | None) -> tuple[str, str | None] | None:
    if not value:
        return None
    site, _, key = value.partition(":")
    if site not in CRASHES:
        raise ValueError(f"{CRASH_ENV}={value!r} names no crash site; known: {', '.join(sorted(CRASHES))}")
    return site, key or None


_crash = _crash_spec(os.environ.get(CRASH_ENV))


def crash_due(site: str, key: str | None = None) -> bool:
    """Whether this process is to die at `site` (always False outside tests); the caller leaves its partial work
    behind, then calls `crash()`."""
    return _crash is not None and _crash[0] == site and _crash[1] in (None, key)


def crash() -> NoReturn:
    """kill -9 of this very process: no finally blocks, no atexit, no flushing of buffers."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(137)  # not reached
