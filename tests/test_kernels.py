"""Each fused kernel against its plain-torch reference (Triton's interpreter runs the kernel on CPU)."""

import os
import subprocess
import sys

import torch

from dspark_sgl.kernels.markov_step import markov_step
from tests.conftest import require


def test_reference_is_the_definition():
    g = torch.Generator().manual_seed(0)
    base, lat, w2 = torch.randn(3, 50, generator=g), torch.randn(3, 8, generator=g), torch.randn(50, 8, generator=g)
    tok, logits = markov_step(base, lat, w2)
    torch.testing.assert_close(logits, base + lat @ w2.T)
    assert torch.equal(tok, (base + lat @ w2.T).argmax(-1))


KERNEL_CHECK = r"""
import torch
from dspark_sgl.kernels.markov_step import markov_step_reference, markov_step_triton
g = torch.Generator().manual_seed(0)
for B, V, R in [(1, 37, 5), (3, 2500, 70), (2, 1024, 64)]:
    base, lat, w2 = torch.randn(B, V, generator=g), torch.randn(B, R, generator=g), torch.randn(V, R, generator=g)
    tok, logits = markov_step_triton(base, lat, w2, block_v=256, block_r=32)
    ref_tok, ref_logits = markov_step_reference(base, lat, w2)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tok, ref_tok), (tok, ref_tok)
# ties go to the lowest id, across blocks too
base = torch.zeros(1, 600); base[0, 10] = base[0, 300] = base[0, 599] = 5.0
tok, _ = markov_step_triton(base, torch.zeros(1, 4), torch.zeros(600, 4), block_v=256, block_r=32)
assert int(tok) == 10
print("ok")
"""


def run_interpreted(script: str, timeout: int = 300) -> None:
    """Run a kernel check script under Triton's CPU interpreter (TRITON_INTERPRET=1, read at import: a fresh
    process); it must print "ok" last."""
    require("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_triton_kernel_matches_reference_in_interpreter():
    run_interpreted(KERNEL_CHECK)


def test_accept_dispatch_on_cpu_is_the_reference():
    """On CPU the dispatchers run dspark_sgl.kernels.accept_reference itself (draft ids mapped through d2t first)."""
    from dspark_sgl.kernels.accept import block_accept_dispatch, greedy_accept_dispatch, rejection_accept_dispatch
    from dspark_sgl.kernels.accept_reference import block_accept, greedy_accept, rejection_accept

    g = torch.Generator().manual_seed(0)
    B, gamma, V = 3, 4, 60
    vocab = torch.arange(0, V, 3)  # K = 20 draft tokens at target ids 0, 3, 6, ...
    d2t = vocab - torch.arange(vocab.numel())
    logits = torch.randn(B, gamma + 1, V, generator=g)
    logits[..., vocab] += 5  # the argmax is a draft-vocabulary token, so drafts can be accepted
    ids = torch.searchsorted(vocab, logits[:, :gamma].argmax(-1))
    ids[1, 1] = (ids[1, 1] + 1) % vocab.numel()
    a, r = greedy_accept_dispatch(ids, logits, d2t=d2t), greedy_accept(vocab[ids], logits)
    assert torch.equal(a.num_accepted, r.num_accepted) and torch.equal(a.bonus, r.bonus)
    assert a.num_accepted.tolist() == [gamma, 1, gamma]
    p, q = torch.softmax(logits, -1), torch.softmax(logits[:, :gamma] * 0.5, -1)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, gamma)
    for dispatch, reference in ((rejection_accept_dispatch, rejection_accept), (block_accept_dispatch, block_accept)):
        for lim in (None, torch.tensor([4, 2, 0])):
            a = dispatch(x, q, p, lim, torch.Generator().manual_seed(1))
            r = reference(x, q, p, lim, torch.Generator().manual_seed(1))
            assert torch.equal(a.num_accepted, r.num_accepted) and torch.equal(a.bonus, r.bonus)
    qk = torch.zeros_like(q)
    qk[..., vocab] = torch.softmax(logits[:, :gamma, vocab] * 0.5, -1)  # a reduced-vocabulary draft
    ids = torch.multinomial(qk[..., vocab].reshape(-1, vocab.numel()), 1, generator=g).view(B, gamma)
    a = block_accept_dispatch(ids, qk, p, None, torch.Generator().manual_seed(2), d2t=d2t)
    r = block_accept(vocab[ids], qk, p, None, torch.Generator().manual_seed(2))
    assert torch.equal(a.num_accepted, r.num_accepted) and torch.equal(a.bonus, r.bonus)


ACCEPT_PRELUDE = r"""
import torch
from dspark_sgl.kernels.noise import ACCEPT, Noise

g = torch.Generator().manual_seed(0)


def same(a, r):
    return torch.equal(a.num_accepted, r.num_accepted) and torch.equal(a.bonus, r.bonus)


def limits(B, gamma):
    yield None
    yield torch.randint(0, gamma + 1, (B,), generator=g)  # limit < γ on some rows
    yield torch.zeros(B, dtype=torch.long)  # limit = 0: only the anchor's argmax
    yield torch.full((B,), gamma + 2)  # above γ: the reference caps at γ


def dists(B, gamma, V, spread):
    # q near p (spread small: most drafts accepted) or far (most rejected); x ~ q
    p = torch.softmax(torch.randn(B, gamma + 1, V, generator=g) * 3, -1)
    q = torch.softmax(torch.log(p[:, :gamma]) + spread * torch.randn(B, gamma, V, generator=g), -1)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, gamma) if gamma else torch.zeros(B, 0).long()
    return x, q, p


def noises(seed, B):
    yield torch.Generator().manual_seed(seed)
    seeded = torch.arange(B) % 2 == 0  # seeded rows hash (seed, position), the rest read the generator
    yield Noise(torch.Generator().manual_seed(seed), torch.arange(B) + 100 * seed, seeded, torch.arange(B) * 7)


class HalfNoise(Noise):  # every accept uniform 1/2, for ties built on purpose
    def uniform(self, B, n, stream, device):
        half = torch.full((B, n), 0.5, dtype=torch.float64)
        return half if stream == ACCEPT else super().uniform(B, n, stream, device)


def reduced_dists(V, K, gamma, B=4):
    # a reduced vocabulary: q zero outside K draft tokens (as draft_probs builds it), drafts in draft ids via d2t
    vocab = torch.randperm(V, generator=g)[:K].sort().values
    p = torch.softmax(torch.randn(B, gamma + 1, V, generator=g) * 2, -1)
    qk = torch.softmax(torch.log(p[:, :gamma, vocab]) + 0.5 * torch.randn(B, gamma, K, generator=g), -1)
    q = torch.zeros(B, gamma, V).index_copy_(-1, vocab, qk)
    ids = torch.multinomial(qk.reshape(-1, K), 1, generator=g).view(B, gamma)
    return vocab, vocab - torch.arange(K), ids, q, p


def check_rule(kernel, reference, x, q, p, lim, d2t, x_target, blocks, seeds):
    # the kernel's c and bonus equal the reference's on the same noise (generator and seeded rows)
    counts = set()
    for s in seeds:
        for bv in blocks:
            for n_out, n_ref in zip(noises(s, x.shape[0]), noises(s, x.shape[0])):
                ref = reference(x if x_target is None else x_target, q, p, lim, n_ref)
                out = kernel(x, q, p, lim, n_out, d2t=d2t, block_v=bv)
                assert same(out, ref), (s, bv, lim, out, ref)
                counts.update(ref.num_accepted.tolist())
    return counts
"""

ACCEPT_CHECK = ACCEPT_PRELUDE + r"""
from dspark_sgl.kernels.accept import greedy_accept_triton, rejection_accept_triton, rejection_prefix_triton
from dspark_sgl.kernels.accept_reference import greedy_accept, rejection_accept

BLOCKS = (64, 256, 1024, 4096)


def greedy_case(B, gamma, V, dtype=torch.float32, extra_rows=0):
    # drafts = the argmax, then one mismatch planted per row at a random position (or none: fully accepted)
    logits = torch.randn(B, gamma + 1 + extra_rows, V, generator=g).to(dtype)
    x = logits[:, :gamma].argmax(-1)
    for b in range(B):
        j = int(torch.randint(0, gamma + 1, (1,), generator=g))
        if j < gamma:
            x[b, j] = (x[b, j] + 1 + b) % V
    return x, logits


# greedy: equality with greedy_accept, every block size, every limit kind
for B, gamma, V, dtype, extra in [(4, 7, 3000, torch.float32, 0), (3, 3, 37, torch.float32, 1),
                                  (2, 0, 500, torch.float32, 0), (4, 5, 700, torch.bfloat16, 0)]:
    x, logits = greedy_case(B, gamma, V, dtype, extra)
    counts = set()
    for lim in limits(B, gamma):
        ref = greedy_accept(x, logits, lim)
        counts.update(ref.num_accepted.tolist())
        for bv in BLOCKS:
            out = greedy_accept_triton(x, logits, lim, block_v=bv)
            assert same(out, ref), (B, gamma, V, dtype, lim, bv, out, ref)
    assert gamma == 0 or len(counts) >= 3, counts  # the cases really spread c over 0..γ
full = greedy_case(2, 6, 300)[1]
x = full[:, :6].argmax(-1)
assert greedy_accept_triton(x, full, block_v=64).num_accepted.tolist() == [6, 6]  # fully accepted

# ties spanning blocks: the maximum at ids 10, 300 and 599 (blocks 0, 1, 2 of 256) -> 10, as torch.argmax
tie = torch.full((2, 2, 600), -9.0)
tie[:, :, [10, 300, 599]] = -2.0  # all logits negative: the running maximum starts at -inf, not 0
x_tie = torch.tensor([[10], [300]])  # row 0 drafts the lowest tied id (accepted), row 1 a higher one (rejected)
ref = greedy_accept(x_tie, tie)
assert ref.num_accepted.tolist() == [1, 0] and ref.bonus.tolist() == [10, 10]
for bv in BLOCKS:
    assert same(greedy_accept_triton(x_tie, tie, block_v=bv), ref), bv

# reduced vocabulary: draft ids through d2t (target id i + d2t[i])
V, K, gamma = 2000, 150, 5
vocab = torch.randperm(V, generator=g)[:K].sort().values
d2t = vocab - torch.arange(K)
logits = torch.randn(4, gamma + 1, V, generator=g)
logits[..., vocab] += 4.0  # the argmax is (nearly always) a draft token
ids = torch.randint(0, K, (4, gamma), generator=g)
best = logits[:, :gamma].argmax(-1)
ids = torch.where(torch.isin(best, vocab), torch.searchsorted(vocab, best), ids)
ids[0, 3], ids[1, 0] = (ids[0, 3] + 1) % K, (ids[1, 0] + 7) % K
for lim in limits(4, gamma):
    ref = greedy_accept(vocab[ids], logits, lim)
    for bv in (128, 1024):
        assert same(greedy_accept_triton(ids, logits, lim, d2t=d2t, block_v=bv), ref), (lim, bv)
assert greedy_accept(vocab[ids], logits).num_accepted[2:].tolist() == [gamma, gamma]

# planted bugs: each perturbed kernel output differs from the reference on these cases
tie_high = greedy_accept_triton(x_tie, tie.flip(-1), block_v=256)  # argmax ties to the highest id
assert not torch.equal(600 - 1 - tie_high.bonus, ref.bonus)
x, logits = greedy_case(4, 7, 3000)
shifted = torch.cat((logits[:, 1:], logits[:, -1:]), 1)  # compares x_{j+1} with row j+1, not row j
assert not same(greedy_accept_triton(x, shifted, block_v=256), greedy_accept(x, logits))
bad = greedy_accept_triton(x, logits, block_v=256)
bad.num_accepted = (bad.num_accepted + 1).clamp(max=7)  # one more accepted
assert not same(bad, greedy_accept(x, logits))


def check_rejection(x, q, p, lim, d2t=None, x_target=None, blocks=(256,), seeds=range(4)):
    return check_rule(rejection_accept_triton, rejection_accept, x, q, p, lim, d2t, x_target, blocks, seeds)


for B, gamma, V, spread in [(4, 7, 3000, 0.7), (3, 3, 500, 2.0), (2, 0, 300, 1.0)]:
    x, q, p = dists(B, gamma, V, spread)
    counts = set()
    for lim in limits(B, gamma):
        counts |= check_rejection(x, q, p, lim, blocks=BLOCKS if V == 3000 else (64,))
    assert gamma == 0 or len(counts) >= 3, counts

# fully accepted (q = p: u·q < p always), so the bonus comes from p at the limit row, q unread there
x, _, p = dists(3, 4, 400, 0.0)
ref_counts = check_rejection(x, p[:, :4].clone(), p, torch.tensor([4, 2, 0]))
assert ref_counts == {4, 2, 0}

# reduced vocabulary: q zero outside K draft tokens (as draft_probs builds it), drafts in draft ids through d2t
V, K, gamma = 1500, 120, 6
vocab, d2t, ids, q, p = reduced_dists(V, K, gamma)
for lim in limits(4, gamma):
    check_rejection(ids, q, p, lim, d2t=d2t, x_target=vocab[ids], blocks=(128,))

# the strict accept test: u·q(x) = p(x) exactly (u = 1/2, q(x) = 2 p(x)) rejects, as the reference's `<`
x, q, p = dists(3, 4, 200, 0.5)
q = p[:, :4].clone()
for b in (1, 2):  # rows 1, 2: a tie at draft 3
    q[b, 2, x[b, 2]] = 2 * p[b, 2, x[b, 2]]
ref = rejection_accept(x, q, p, None, HalfNoise(torch.Generator().manual_seed(0)))
assert ref.num_accepted.tolist() == [4, 2, 2]
assert same(rejection_accept_triton(x, q, p, None, HalfNoise(torch.Generator().manual_seed(0)), block_v=64), ref)

# the kernel's residual is the reference's max(p_c - q_c, 0), bit for bit (so torch's normalising sum matches)
x, q, p = dists(4, 7, 3000, 0.7)
u = torch.rand(4, 7, generator=g, dtype=torch.float64)
c, resid = rejection_prefix_triton(x, q, p, u, block_v=256)
ar = torch.arange(4)
q_c = torch.where((c < 7)[:, None], torch.cat((q, q[:, :1] * 0), 1)[ar, c], 0.0)
assert torch.equal(resid, (p[ar, c] - q_c).clamp(min=0))

# planted bugs: kernel-side noise not shared with the reference, and a kernel that never reads q
ref = rejection_accept(x, q, p, None, torch.Generator().manual_seed(0))
own = rejection_accept_triton(x, q, p, None, torch.Generator().manual_seed(1), block_v=256)
assert not same(own, ref)
u = Noise(torch.Generator().manual_seed(0)).uniform(4, 7, ACCEPT, "cpu")
c, resid = rejection_prefix_triton(x, q, p, u, block_v=256)
assert torch.equal(c, ref.num_accepted)
assert not same(rejection_accept_triton(x, q * 0, p, None, torch.Generator().manual_seed(0), block_v=256), ref)
print("ok")
"""


def test_accept_kernels_match_reference_in_interpreter():
    run_interpreted(ACCEPT_CHECK, timeout=600)


BLOCK_CHECK = ACCEPT_PRELUDE + r"""
from dspark_sgl.kernels.accept import block_accept_triton, block_prefix_triton
from dspark_sgl.kernels.accept_reference import block_accept, greedy_accept


def check_block(x, q, p, lim, d2t=None, x_target=None, blocks=(64,), seeds=range(3)):
    return check_rule(block_accept_triton, block_accept, x, q, p, lim, d2t, x_target, blocks, seeds)


# V = 300 over blocks of 64 (a ragged last one), 256 and 512 (one masked block); γ = 1 and γ = 0 too
for B, gamma, V, spread, blocks in [(4, 5, 300, 0.7, (64, 256, 512)), (3, 3, 100, 2.0, (64,)),
                                    (4, 1, 64, 1.0, (64,)), (2, 0, 64, 1.0, (64,))]:
    x, q, p = dists(B, gamma, V, spread)
    counts = set()
    for lim in [*limits(B, gamma), torch.full((B,), gamma)]:
        counts |= check_block(x, q, p, lim, blocks=blocks)
    assert len(counts) >= min(3, gamma + 1), counts

# h_i from R_i really decides: some rows stop at 0 < c < L with 0 < ρ_c < 1 (an h_i other than ρ_i or 0/1)
x, q, p = dists(8, 5, 300, 0.7)
u = Noise(torch.Generator().manual_seed(0)).uniform(8, 5, ACCEPT, "cpu")
c, rho_c, resid = block_prefix_triton(x, q, p, u, block_v=64)
assert ((c > 0) & (c < 5) & (rho_c > 0) & (rho_c < 1)).any(), (c, rho_c)
assert torch.equal(c, block_accept(x, q, p, None, Noise(torch.Generator().manual_seed(0))).num_accepted)

# q = 0 at a drafted token: ρ is 0 from there on, so h is 0 and nothing at or after it is accepted
q0 = q.clone()
q0[0, 1, x[0, 1]] = 0.0
q0[2, 0, x[2, 0]] = 0.0
for s in range(3):
    ref = block_accept(x, q0, p, None, torch.Generator().manual_seed(s))
    assert ref.num_accepted[0] <= 1 and ref.num_accepted[2] == 0, ref.num_accepted
check_block(x, q0, p, None)
check_block(x, q0, p, torch.tensor([5, 1, 0, 3, 5, 2, 4, 5]))

# one-hot p (a greedy target) against a soft q; and one-hot p and q, where block is the greedy rule
onehot = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).float()
for lim in limits(8, 5):
    check_block(x, q, onehot, lim)
xg = onehot[:, :5].argmax(-1)
xg[1, 2], xg[3, 0] = (xg[1, 2] + 1) % 300, (xg[3, 0] + 1) % 300  # two mismatches
qg = torch.nn.functional.one_hot(xg, 300).float()
for lim in limits(8, 5):
    ref = block_accept(xg, qg, onehot, lim, torch.Generator().manual_seed(0))
    assert same(ref, greedy_accept(xg, onehot, lim))
    check_block(xg, qg, onehot, lim)

# reduced vocabulary: q zero outside K draft tokens, drafts in draft ids through d2t
V, K, gamma = 300, 40, 4
vocab, d2t, ids, q, p = reduced_dists(V, K, gamma)
for lim in [*limits(4, gamma), torch.full((4,), gamma)]:
    check_block(ids, q, p, lim, d2t=d2t, x_target=vocab[ids])

# strict η < h: q = p but for q(x_1) = 2 p(x_1), so ρ_i = 1/2 exactly for every i; then R_i = 0 (h_i = 0) for
# i < L and h_L = ρ_L = 1/2 = η: nothing is accepted (a `<=` would accept L)
x, q, p = dists(3, 3, 100, 0.5)
q = p[:, :3].clone()
q[torch.arange(3), 0, x[:, 0]] = 2 * p[torch.arange(3), 0, x[:, 0]]
lim = torch.tensor([3, 2, 1])
ref = block_accept(x, q, p, lim, HalfNoise(torch.Generator().manual_seed(0)))
assert ref.num_accepted.tolist() == [0, 0, 0]
assert same(block_accept_triton(x, q, p, lim, HalfNoise(torch.Generator().manual_seed(0)), block_v=64), ref)
print("ok")
"""


def test_block_kernel_matches_reference_in_interpreter():
    run_interpreted(BLOCK_CHECK, timeout=600)
