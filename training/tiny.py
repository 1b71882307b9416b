"""A tiny random Llama target with a real BPE tokenizer and chat template, built offline in a second.

Tests and smoke runs use it to exercise the whole pipeline (chat template, regeneration, capture, streaming, FSDP,
resume) without any download.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "one two three four five six seven eight nine ten", "how many eggs does the duck lay per day",
    "please reason step by step and put your final answer in a box", "hello how are you today my friend",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = ( ) ? ! . , : ;",
]


def tiny_conversations(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    words = " ".join(CORPUS).split()
    pick = lambda k: " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=g))
    return [{"conversations": [{"from": "human", "value": pick(6 + i % 5)},
                               {"from": "gpt", "value": pick(10 + i % 13)}]} for i in range(n)]


def build_tiny_target(folder: str | Path, hidden: int = 32, layers: int = 4, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper than the default init, so greedy regeneration is not a constant string
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def mask_token_id(folder: str | Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("<|mask|>")
