import pytest
import torch

from dspark_sgl.targets import HFTarget, TargetKV
from tests.conftest import tiny_llama


def hand_forward(model, ids):
    """The decoder written out by hand: embed, then each layer on explicit RoPE, then the final norm."""
    dec = model.model
    pos = torch.arange(ids.shape[1])[None]
    x = dec.embed_tokens(ids)
    rope = dec.rotary_emb(x, pos)
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
    outs = []
    for layer in dec.layers:
        x = layer(x, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        outs.append(x)
    return outs, dec.norm(x)


def test_aux_id_i_is_the_output_of_decoder_layer_i():
    model = tiny_llama()
    target = HFTarget(model, [0, 2, 3])
    ids = torch.randint(0, 64, (1, 9))
    out = target.forward(ids)
    layer_outs, final = hand_forward(model, ids)
    H = target.hidden_size
    for j, i in enumerate([0, 2, 3]):
        torch.testing.assert_close(out.aux[..., j * H:(j + 1) * H], layer_outs[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.last_hidden, final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, model.lm_head(final), atol=1e-5, rtol=1e-5)
    # transformers' hidden_states[i + 1] names the same tensor for every layer but the last (post-norm there).
    hs = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.aux[..., H:2 * H], hs[3], atol=1e-5, rtol=1e-5)


def test_bad_layer_ids():
    with pytest.raises(ValueError, match="outside the target's 4 decoder layers"):
        HFTarget(tiny_llama(), [1, 4])


def test_ragged_batch_with_rollback_matches_independent_requests():
    """Left-padded batch, ragged keeps per step == each request run alone with plain cropping."""
    target = HFTarget(tiny_llama(), [1])
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    kv = TargetKV(target, prompts)
    kv.prefill()
    g = torch.Generator().manual_seed(0)
    seqs = [list(p) for p in prompts]
    for _ in range(4):
        new = torch.randint(1, 64, (3, 4), generator=g)
        out = kv.extend(new)
        for b in range(3):  # reference: the same request alone, full recompute
            ref = target.forward(torch.tensor([seqs[b] + new[b].tolist()]))
            torch.testing.assert_close(out.logits[b], ref.logits[0, -4:], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out.aux[b], ref.aux[0, -4:], atol=1e-4, rtol=1e-4)
        keep = torch.randint(1, 5, (3,), generator=g)
        kv.commit(4, keep)
        for b in range(3):
            seqs[b] += new[b, : keep[b]].tolist()
        assert kv.lengths.tolist() == [len(s) for s in seqs]


def test_select_drops_finished_requests_and_trims_padding():
    target = HFTarget(tiny_llama(), [1])
    prompts = [[3, 4, 5, 6, 7, 8, 9], [8, 9], [10, 11, 12]]
    kv = TargetKV(target, prompts)
    kv.prefill()
    kv.select(torch.tensor([1, 2]))  # the longest request finished: its padding columns go too
    assert kv.width == 3 and kv.pad.tolist() == [1, 0]
    new = torch.tensor([[20, 21], [22, 23]])
    out = kv.extend(new)
    for b, p in enumerate(prompts[1:]):
        ref = target.forward(torch.tensor([p + new[b].tolist()]))
        torch.testing.assert_close(out.logits[b], ref.logits[0, -2:], atol=1e-4, rtol=1e-4)


def test_rolled_back_columns_stay_hidden_and_positions_follow_each_row():
    """In-place per-row KV: after ragged rollbacks, rows leaving and the buffers growing, every forward equals a full
    recompute of each request alone, even with the columns past each row's end filled with garbage (a rejected
    token left visible, or a position id that ignores a row's rollback, changes the logits)."""
    target = HFTarget(tiny_llama(), [1])
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13]]
    kv = TargetKV(target, prompts)  # no reserve: the buffers grow on the way
    kv.prefill()
    g = torch.Generator().manual_seed(1)
    seqs, live = [list(p) for p in prompts], [0, 1, 2, 3]
    for step in range(6):
        if step == 3:  # requests 0 and 3 finish: columns that are padding in both others go too
            live = [1, 2]
            kv.select(torch.tensor([1, 2]))
        for t in kv.cache.keys + kv.cache.values:  # garbage in every column past a row's end
            t.masked_fill_((torch.arange(t.shape[2]) >= kv.end[:, None])[:, None, :, None], 1e3)
        new = torch.randint(1, 64, (len(live), 4), generator=g)
        out = kv.extend(new)
        for b, r in enumerate(live):
            ref = target.forward(torch.tensor([seqs[r] + new[b].tolist()]))
            torch.testing.assert_close(out.logits[b], ref.logits[0, -4:], atol=1e-4, rtol=1e-4)
        keep = torch.randint(0, 5, (len(live),), generator=g)
        kv.commit(4, keep)
        for b, r in enumerate(live):
            seqs[r] += new[b, : keep[b]].tolist()
        assert kv.lengths.tolist() == [len(seqs[r]) for r in live]
