"""Match proposals from a request's own text, and the per-request choice between them and the draft's block.

Code and edits repeat their prompt: where the text so far ends with an n-gram seen before, the tokens that followed
it last time are a proposal that costs nothing to make (prompt lookup / n-gram decoding, SGLang's NGRAM, suffix
decoding). A small draft is weakest exactly there, and the target's verify does not care where a proposal came
from, so each step verifies whichever of the two blocks is expected to commit more. One definition for both engines
(speculative/engine.py, sglang/worker.py), on the host:

    MatchIndex    one request's incremental suffix index: n-gram (n = min_n..max_n) -> the last position it ended at,
                  updated with the committed tokens only (O(max_n) dict operations per token, no rescan), holding at
                  most `window` end positions and ~2 x window tokens (bounded memory per request)
    lookup        the longest suffix (n <= max_n) that occurred before, at its most recent occurrence, and the up to
                  γ tokens that followed it; the match length n is the match's score
    MatchChooser  the batch's step: propose a match for every row, estimate both proposals' expected accepted length,
                  build ONE Proposal whose rows are the draft's or the match's, record what the verify accepted;
                  and, on a step the full-cost rule priced as off, a match step (`match_only`): the matches alone,
                  verified without any draft pass when FullCostRule.match_width says they pay (NGRAM's cost, with
                  its acceptance learnt per request and match length)

Lossless. A match proposal is a deterministic function of the committed text, so it is a proposal with a one-hot q:
the rules in kernels/accept_reference.py, unchanged, accept x with probability p(x) and otherwise draw the bonus from
the residual norm(max(p - onehot(x), 0)) = p without x, renormalised (block verification likewise), with every sampling
parameter and the reduced vocabulary as for the draft (`hybrid_proposal` writes the rows as logits that are 0 at the
token and -inf elsewhere, over the full vocabulary, so softmax(l / T) is that one-hot q at any T).
Which proposal a row verifies may depend on anything except the random draws the verified proposal was made from:
  - the match rows' tokens are fixed by the committed text, so the choice may read them and anything else (the
    draft's tokens included): conditioned on the choice they are still the same deterministic tokens, and the
    verify's uniforms are drawn afterwards, independently;
  - the draft rows' tokens are random on sampled rows. Choosing the draft because its sampled tokens look good would
    condition them on that event, so that they are no longer distributed as the q the verify divides by (the
    "peek-ahead" bias tests/test_scheduler.py shows). So on a sampled row the draft's expectation reads only its first
    confidence c_1 (a function of the anchor and the draft's hidden state, computed before anything is sampled),
    extrapolated geometrically: sum_j c_1^j. On a greedy row every token is a deterministic function of the text and
    the full survival sum_j prod_{i<=j} c_i is read.
  - the running acceptance estimates come from earlier steps' outcomes only.
tests/test_match.py's chi-square test is the judge (and a planted residual that keeps x fails it).

Expected accepted length of a match of length n with k tokens of continuation: sum_{j<=k} a^j, a the request's
running acceptance rate of matches of that length (accepted / tested tokens, tested = accepted + 1 when the row
stopped at a rejection), shrunk towards the engine-wide rate for that length with `prior` pseudo-observations.
Without a confidence head the draft uses the same estimator on its own past steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dspark_sgl.speculative.markov import Proposal


@dataclass(frozen=True)
class MatchConfig:
    """The proposer's and the estimator's settings (the recipe / server field `match`)."""

    max_n: int = 8  # longest n-gram indexed: the largest match length (score)
    min_n: int = 1  # shortest match proposed
    window: int = 4096  # most recent n-gram end positions kept per request
    prior: float = 4.0  # pseudo-observations of the engine-wide rate in a request's estimate

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"match lengths need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.window < 1 or self.prior < 0:
            raise ValueError(f"match window must be >= 1 and prior >= 0, got {self.window}, {self.prior}")


class MatchIndex:
    """One request's suffix index over its committed tokens (prompt + output so far).

    For each n in min_n..max_n a dict maps every n-gram to the last position e at which it ended (exclusive end).
    The n-grams ending at the current end are registered only when the next token arrives, so a lookup never finds
    the suffix itself. End positions older than `window` tokens are evicted, and the token buffer is trimmed to what
    a kept occurrence's key and continuation can still read."""

    def __init__(self, cfg: MatchConfig = MatchConfig(), tokens: Sequence[int] = ()):
        self.cfg = cfg
        self._tok: list[int] = []  # tokens from absolute position self._base on
        self._base = 0
        self._len = 0  # tokens committed so far
        self._oldest = 1  # the oldest registered end position not yet evicted
        self._idx: list[dict[tuple[int, ...], int]] = [{} for _ in range(cfg.max_n + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return self._len

    def _key(self, end: int, n: int) -> tuple[int, ...]:
        return tuple(self._tok[end - n - self._base : end - self._base])

    def extend(self, tokens: Sequence[int]) -> None:
        cfg = self.cfg
        for t in tokens:
            end = self._len  # the n-grams ending here become findable now that a token follows them
            for n in range(cfg.min_n, min(cfg.max_n, end) + 1):
                self._idx[n][self._key(end, n)] = end
            self._tok.append(int(t))
            self._len += 1
            while self._oldest < self._len - cfg.window:  # evict ends older than the window
                old = self._oldest
                for n in range(cfg.min_n, min(cfg.max_n, old) + 1):
                    key = self._key(old, n)
                    if self._idx[n].get(key) == old:
                        del self._idx[n][key]
                self._oldest += 1
        keep_from = max(self._len - cfg.window - cfg.max_n - 1, 0)  # earliest token a kept key reads
        if keep_from - self._base > cfg.window + cfg.max_n:  # trim in chunks: amortised O(1) per token
            del self._tok[: keep_from - self._base]
            self._base = keep_from

    def lookup(self, gamma: int) -> tuple[list[int], int]:
        """(the up to γ tokens that followed the longest earlier occurrence of a suffix, its length n); ([], 0) when
        no suffix of length >= min_n occurred before within the window."""
        L = self._len
        for n in range(min(self.cfg.max_n, L - 1), self.cfg.min_n - 1, -1):
            end = self._idx[n].get(self._key(L, n))
            if end is not None:
                return self._tok[end - self._base : min(end + gamma, L) - self._base], n
        return [], 0


def brute_force_lookup(tokens: Sequence[int], gamma: int, cfg: MatchConfig = MatchConfig()) -> tuple[list[int], int]:
    """The definition MatchIndex.lookup implements, by direct search (tests' independent reference): the largest
    n <= max_n for which tokens[-n:] also ends at some earlier position e (n <= e < len, e >= len - window), the most
    recent such e, and tokens[e : e + γ]."""
    L = len(tokens)
    for n in range(min(cfg.max_n, L - 1), cfg.min_n - 1, -1):
        suffix = list(tokens[L - n :])
        for e in range(L - 1, max(n, L - cfg.window) - 1, -1):
            if list(tokens[e - n : e]) == suffix:
                return list(tokens[e : e + gamma]), n
    return [], 0


@dataclass
class _Rate:
    """Accepted and tested proposal tokens (tested = accepted, plus one where the row stopped at a rejection)."""

    accepted: float = 0.0
    tested: float = 0.0

    def add(self, accepted: int, tested: int) -> None:
        self.accepted += accepted
        self.tested += tested

    def rate(self, prior: _Rate | float, weight: float) -> float:
        base = prior if isinstance(prior, float) else (prior.accepted + 1.0) / (prior.tested + 2.0)
        return (self.accepted + weight * base) / (self.tested + weight)


@dataclass
class MatchState:
    """One request's index and its running acceptance counts (by match length; the draft's as key 0)."""

    index: MatchIndex
    rates: dict[int, _Rate] = field(default_factory=dict)


@dataclass
class MatchCounters:
    """What the engines report: steps per source, drafts accepted per source (accept length = 1 + accepted/steps)."""

    steps: dict[str, int] = field(default_factory=lambda: {"draft": 0, "match": 0})
    accepted: dict[str, int] = field(default_factory=lambda: {"draft": 0, "match": 0})

    def add(self, from_match: bool, accepted: int) -> None:
        src = "match" if from_match else "draft"
        self.steps[src] += 1
        self.accepted[src] += accepted

    def to_dict(self) -> dict:
        total = sum(self.steps.values())
        return {
            "steps": dict(self.steps), "accepted": dict(self.accepted),
            "match_share": self.steps["match"] / total if total else 0.0,
            "accept_length": {s: 1.0 + self.accepted[s] / n if n else None for s, n in self.steps.items()},
        }

    def clear(self) -> None:
        self.steps, self.accepted = {"draft": 0, "match": 0}, {"draft": 0, "match": 0}


def expected_accepted(survival: Tensor) -> Tensor:
    """[B, γ] survival a_j = P(draft j accepted) -> [B] expected accepted drafts sum_j a_j."""
    return survival.sum(-1)


def one_hot_logits(tokens: Tensor, vocab_size: int) -> Tensor:
    """[B, γ] tokens -> [B, γ, V] logits 0 at the token, -inf elsewhere: softmax(l / T) is one-hot at every T."""
    out = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device)
    return out.scatter_(-1, tokens[..., None].long(), 0.0)


def hybrid_proposal(prop: Proposal, match_tokens: Tensor, use_match: Tensor, vocab_size: int) -> Proposal:
    """One Proposal whose rows are the match's (use_match [B]) or the draft's: tokens from either, logits over the
    full vocabulary (a reduced draft's K logits placed at their target ids, -inf elsewhere: the same q as the draft's
    own; the match rows one-hot), so the shared acceptance rules verify both kinds of row in one pass."""
    if prop.vocab is None:
        logits = prop.logits.float()
    else:
        logits = torch.full((*prop.logits.shape[:-1], vocab_size), float("-inf"), device=prop.logits.device)
        logits[..., prop.vocab.to(logits.device)] = prop.logits.float()
    rows = use_match.to(prop.tokens.device)
    tokens = torch.where(rows[:, None], match_tokens.to(prop.tokens.device), prop.tokens)
    logits = torch.where(rows[:, None, None], one_hot_logits(tokens, vocab_size), logits)
    return Proposal(tokens, logits, prop.conf_logits, None, from_match=rows)


class MatchChooser:
    """The hybrid's per-step logic for a batch of rows, each with its MatchState (the engine owns the states)."""

    def __init__(self, cfg: MatchConfig = MatchConfig()):
        self.cfg = cfg
        self.rates: dict[int, _Rate] = {}  # engine-wide, by match length (0: the draft)
        self.counters = MatchCounters()

    def new_state(self, tokens: Sequence[int] = ()) -> MatchState:
        return MatchState(MatchIndex(self.cfg, tokens))

    def _rate(self, state: MatchState | None, key: int) -> float:
        glob = self.rates.get(key, _Rate())
        return (state.rates.get(key, _Rate()) if state is not None else _Rate()).rate(glob, self.cfg.prior)

    def propose(self, states: Sequence[MatchState | None], gamma: int, device) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens [B, γ] long, continuation length k [B] long, match length n [B] long) on `device`. Rows with k < γ
        repeat their last token (the row's verify limit stops at k); rows with no match (or no state: the hybrid is
        off for that row) hold zeros and k = n = 0."""
        toks = torch.zeros(len(states), gamma, dtype=torch.long)
        k = torch.zeros(len(states), dtype=torch.long)
        n = torch.zeros(len(states), dtype=torch.long)
        for b, st in enumerate(states):
            cont, length = st.index.lookup(gamma) if st is not None else ([], 0)
            if cont:
                toks[b] = torch.tensor(cont + [cont[-1]] * (gamma - len(cont)))
                k[b], n[b] = len(cont), length
        return toks.to(device), k.to(device), n.to(device)

    def match_survival(self, states: Sequence[MatchState], k: Tensor, n: Tensor, gamma: int) -> Tensor:
        """[B, γ] float64 survival of the match rows: a^j for j <= k, 0 beyond (a by request and match length)."""
        a = torch.tensor([self._rate(st, m) if m > 0 else 0.0 for st, m in zip(states, n.tolist(), strict=True)],
                         dtype=torch.float64)
        j = torch.arange(1, gamma + 1, dtype=torch.float64)
        return torch.where(j[None] <= k.cpu()[:, None], a[:, None] ** j[None], 0.0)

    def draft_survival(self, states: Sequence[MatchState], conf: Tensor | None, greedy: Tensor, gamma: int
                       ) -> Tensor:
        """[B, γ] float64 survival of the draft rows as the choice may read it: the calibrated confidences' full
        survival on greedy rows, c_1^j on sampled rows (see the module docstring); without a confidence head the
        request's running rate of the draft, a^j."""
        j = torch.arange(1, gamma + 1, dtype=torch.float64)
        if conf is None:
            a = torch.tensor([self._rate(st, 0) if st is not None else 0.0 for st in states], dtype=torch.float64)
            return a[:, None] ** j[None]
        c = conf.detach().double().cpu().nan_to_num(0.0).clamp(0.0, 1.0)
        full = c.cumprod(-1)
        first = c[:, :1] ** j[None]
        return torch.where(greedy.cpu()[:, None], full, first)

    def choose(self, states: Sequence[MatchState], prop: Proposal, conf: Tensor | None, greedy: Tensor,
               vocab_size: int, cand: MatchStep | None = None) -> Choice:
        """This step's Proposal to verify: per row, the match's block when its expected accepted length beats the
        draft's (and some suffix matched), else the draft's. `cand`: this step's matches when already looked up
        (`match_only`, which the full-cost rule read before drafting)."""
        gamma = prop.tokens.shape[1]
        dev = prop.tokens.device
        cand = cand if cand is not None else self.match_only(states, gamma, dev)
        toks, k, n, m_surv = cand.tokens.to(dev), cand.k, cand.n, cand.survival
        d_surv = self.draft_survival(states, conf, greedy, gamma)
        use = (k.cpu() > 0) & (expected_accepted(m_surv) > expected_accepted(d_surv))
        use_dev = use.to(dev)
        if conf is not None:  # per-position conditional confidences: the match's rate up to k, 0 beyond
            j = torch.arange(1, gamma + 1)
            m_conf = torch.where(j[None] <= k.cpu()[:, None], m_surv[:, :1], 0.0).to(conf.device, conf.dtype)
            conf = torch.where(use_dev[:, None], m_conf, conf)
        return Choice(hybrid_proposal(prop, toks, use_dev, vocab_size), conf, use,
                      torch.where(use, k.cpu(), gamma), torch.where(use, n.cpu(), 0))

    def match_only(self, states: Sequence[MatchState | None], gamma: int, device) -> MatchStep:
        """A match step's candidates (no draft pass: a step the full-cost rule priced as off) and their survival
        [B, γ] for `FullCostRule.match_width`; `MatchStep.choice` builds the verify's Proposal only when the width
        says the step runs (the one-hot rows are [B, γ, V]: not built for an off step)."""
        toks, k, n = self.propose(states, gamma, device)
        return MatchStep(toks, k.cpu(), n.cpu(), self.match_survival(states, k, n, gamma))

    def record(self, states: Sequence[MatchState], choice: Choice, limit: Sequence[int], accepted: Sequence[int]
               ) -> None:
        """After the verify: what each row's proposal achieved (limit: the drafts it could accept, its cap included).
        Host lists: the engines read them where they already are on the host."""
        for st, use, key, L, c in zip(states, choice.use_match.tolist(), choice.key.tolist(), limit, accepted,
                                      strict=True):
            self.record_one(st, use, key, L, c)

    def record_one(self, state: MatchState | None, use: bool, key: int, limit: int, accepted: int) -> None:
        """One row's outcome into the request's and the engine-wide rates of its source (the match length, or 0 for
        the draft, -1 for a row of a match step that had no match: nothing recorded) and the counters; tested =
        accepted, plus one where the row stopped at a rejection."""
        if key < 0:
            return
        tested = accepted + 1 if accepted < limit else accepted
        for rates in (() if state is None else (state.rates,)) + (self.rates,):
            rates.setdefault(key, _Rate()).add(accepted, tested)
        self.counters.add(use, accepted)


@dataclass
class MatchStep:
    """The matches of a step the rule priced as off: tokens [B, γ] (on the device), continuation length k and match
    length n [B] (host), survival [B, γ] (host, float64)."""

    tokens: Tensor
    k: Tensor
    n: Tensor
    survival: Tensor

    def choice(self, vocab_size: int) -> Choice:
        """Rows with a match verify it (cap k); the others only their anchor (cap 0, key -1: nothing to learn)."""
        use = self.k > 0
        prop = Proposal(self.tokens, one_hot_logits(self.tokens, vocab_size), None, None,
                        from_match=use.to(self.tokens.device))
        return Choice(prop, None, use, self.k, torch.where(use, self.n, -1))


@dataclass
class Choice:
    """One step's choice: the Proposal to verify, its rows' calibrated per-position confidences for the width rule
    (None without a confidence head), and on the host: which rows verify the match, each row's cap on accepted drafts
    (k on match rows, γ on draft rows) and its estimator key (the match length, 0 for the draft, -1 for a row of a
    match step that verifies its anchor alone)."""

    proposal: Proposal
    conf: Tensor | None
    use_match: Tensor
    cap: Tensor
    key: Tensor
