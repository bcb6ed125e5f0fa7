"""A byte-level BPE tokenizer for synthetic models, with exactly the model's vocab_size.

Trained on a small built-in corpus and padded with deterministic merges, so the same
vocab_size and chat format always give the same tokenizer. Special tokens follow the
chat format (chatml, llama3, mistral) so chat templates and stop tokens work as in the
real model family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlocal.errors import ConfigError

TEMPLATES_DIR = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class TokenizerStyle:
    """Special tokens of a chat format; they take the highest ids, in this order."""

    special: tuple[str, ...]
    extra: tuple[str, ...]  # added but not special: kept when decoding
    bos: str | None
    eos: str
    pad: str | None
    stop: tuple[str, ...]  # generation_config eos_token_id


STYLES: dict[str, TokenizerStyle] = {
    "chatml": TokenizerStyle(
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        extra=("<tool_call>", "</tool_call>", "<think>", "</think>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stop=("<|im_end|>", "<|endoftext|>"),
    ),
    "llama3": TokenizerStyle(
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        extra=(),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        stop=("<|end_of_text|>", "<|eot_id|>"),
    ),
    "mistral": TokenizerStyle(
        special=(
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        extra=(),
        bos="<s>",
        eos="</s>",
        pad="</s>",
        stop=("</s>",),
    ),
}

# Training text for the BPE merges: enough variety for word-like tokens. The rest of
# the vocabulary is filled deterministically (see _extend_vocab).
_CORPUS = """\
The small model answered the question quickly, and the user asked another one.
Local inference means the weights stay on your own machine: no network, no account,
and no waiting in a queue. Memory bandwidth decides how fast each token arrives.
A chat turn starts with a system message, then the user speaks and the assistant
replies. Tools let the assistant call functions, read files, and search the web.
When the cache already holds the prompt, only the new tokens need to be computed.
Quantization stores each weight in four or eight bits with a scale and a bias for
every group of sixty-four values, which cuts memory use by a factor of three or four.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for (int i = 0; i < count; ++i) { total += values[i]; }
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Please summarize the following text in three sentences, then list the key points.
What is the capital of France? The capital of France is Paris.
"""
_WORDS = (
    "the a model token user assistant system tool cache memory prompt answer question "
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company number point "
    "work government night water room mother area money story fact month lot right "
    "study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute "
    "idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air "
    "teacher force education is was are be have do say get make go know take see come "
    "think look want give use find tell ask work seem feel try leave call good new first "
    "last long great little own other old right big high different small large next early "
    "young important few public bad same able"
).split()


def _corpus() -> list[str]:
    lines = _CORPUS.splitlines()
    # Generated sentences and numbers widen the merges beyond the paragraphs above.
    n = len(_WORDS)
    for i in range(3000):
        words = [_WORDS[(i * k * 7 + k * 13 + i) % n] for k in range(1, 9)]
        lines.append(" ".join(words).capitalize() + (".", "?", "!", ",")[i % 4])
    lines += [f"{i} + {i * 3} = {i * 4}; x_{i} = f({i}, {i % 7})" for i in range(2000)]
    return lines


def chat_template_text(name: str) -> str:
    path = TEMPLATES_DIR / f"{name}.jinja"
    if name not in STYLES or not path.is_file():
        raise ConfigError(f"unknown chat template {name!r}; expected one of {sorted(STYLES)}")
    return path.read_text(encoding="utf-8")


def _extend_vocab(vocab: dict[str, int], merges: list[list[str]], target: int) -> None:
    """Add merges (concatenations of existing tokens) until len(vocab) == target.

    Pairs are taken along anti-diagonals of (learned tokens first, then bytes), so short
    common pieces combine first; deterministic because the trained vocab is.
    """
    while len(vocab) < target:
        order = sorted(vocab.items(), key=lambda kv: kv[1])
        base = [t for t, i in order if i >= 256] + [t for t, i in order if i < 256]
        n = len(base)
        for s in range(2 * n - 1):
            for i in range(max(0, s - n + 1), min(s, n - 1) + 1):
                a, b = base[i], base[s - i]
                if a + b not in vocab:
                    vocab[a + b] = len(vocab)
                    merges.append([a, b])
                    if len(vocab) >= target:
                        return


def build_tokenizer(vocab_size: int, chat_template: str = "chatml"):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    style = STYLES[chat_template]
    added = [*style.special, *style.extra]
    n_base = vocab_size - len(added)
    if n_base < 257:
        raise ConfigError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer "
            f"(needs at least {257 + len(added)})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = BpeTrainer(
        vocab_size=n_base,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)

    # Pad the model part to n_base through its JSON form (the Rust side has no API).
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = [m.split(" ", 1) if isinstance(m, str) else m
                               for m in data["model"]["merges"]]
    _extend_vocab(vocab, merges, n_base)
    data["model"]["merges"] = merges
    tok = Tokenizer.from_str(json.dumps(data))

    special = [AddedToken(t, special=True, normalized=False) for t in style.special]
    extra = [AddedToken(t, special=False, normalized=False) for t in style.extra]
    tok.add_special_tokens(special)
    tok.add_tokens(extra)
    tok.decoder = decoders.ByteLevel()
    post: list[Any] = [processors.ByteLevel(trim_offsets=False)]
    if style.bos is not None:
        # Llama and Mistral tokenizers prepend BOS when encoding plain text.
        bos = (style.bos, tok.token_to_id(style.bos))
        post.append(processors.TemplateProcessing(
            single=f"{style.bos} $A", pair=f"{style.bos} $A {style.bos} $B", special_tokens=[bos]
        ))
    tok.post_processor = processors.Sequence(post)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ConfigError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok


def write_tokenizer(path: Path, vocab_size: int, chat_template: str = "chatml",
                    model_max_length: int | None = None) -> dict[str, Any]:
    """Write tokenizer.json + tokenizer_config.json; return bos/eos/pad token ids."""
    style = STYLES.get(chat_template)
    if style is None:
        raise ConfigError(f"unknown chat template {chat_template!r}; expected {sorted(STYLES)}")
    template = chat_template_text(chat_template)
    tok = build_tokenizer(vocab_size, chat_template)
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (*style.special, *style.extra)}
    decoder = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t in style.special}
        for t in ids
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": style.bos,
        "eos_token": style.eos,
        "pad_token": style.pad,
        "unk_token": None,
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length or 131072,
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {k: v for k, v in (("bos_token", style.bos), ("eos_token", style.eos),
                                     ("pad_token", style.pad)) if v is not None}
    (path / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return {
        "bos_token_id": ids[style.bos] if style.bos else None,
        "eos_token_id": ids[style.eos],
        "pad_token_id": ids[style.pad] if style.pad else None,
        "stop_token_ids": [ids[t] for t in style.stop],
    }
