"""What the endpoint benchmark sends, and how it counts tokens when a server reports none.

Synthetic prompts are deterministic and distinct per request (so a prefix cache cannot make
requests 2..n free); prompt files are plain text or JSONL. TokenCounter is the fallback for
servers without `usage`: a transformers tokenizer if one loads, else characters / 4.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlocal.errors import EndpointBenchError

# Filler for synthetic prompts: ordinary words, drawn per request from a seeded RNG.
_WORDS = (
    "the river city light morning garden window stone music paper forest winter road market "
    "silver quiet history engine table bridge ocean mountain letter story simple careful yellow "
    "animal machine number planet summer village painter kitchen doctor island theory journey "
    "golden people evening orange school coffee mirror language garden station cloud rabbit "
    "thunder velvet harbor lantern meadow puzzle signal timber whisper canyon falcon glacier "
    "orchard pepper quartz saddle tunnel violet walnut zephyr anchor bamboo candle desert "
    "ember fabric granite hollow ivory jasmine kettle lemon marble nectar olive pillow"
).split()


@dataclass
class Prompt:
    messages: list[dict]
    text: str  # the user-visible text, for counting prompt tokens without usage


def synthetic_prompts(n: int, prompt_tokens: int, counter: TokenCounter | None = None,
                      vary: bool = True, seed: int = 0) -> list[Prompt]:
    """n deterministic prompts of about `prompt_tokens` tokens.

    Each request gets its own text (its own opening words) unless vary=False, so a prefix cache
    cannot turn request 2..n into a free hit. With a tokenizer the text is cut to the exact
    token count (before the chat template); without one, to prompt_tokens * 4 characters.
    """
    tok = counter.load() if counter else None
    out: list[Prompt] = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + (i if vary else 0))
        head = f"Request {i if vary else 0}. Continue this text:"
        words = [head]
        chars = len(head)
        target_chars = prompt_tokens * 4 + 16
        while chars < target_chars * (2 if tok else 1):
            w = rng.choice(_WORDS)
            words.append(w)
            chars += len(w) + 1
        text = " ".join(words)
        if tok is not None:
            ids = _encode(tok, text)[:max(prompt_tokens, 1)]
            text = tok.decode(ids)
        else:
            text = text[:max(prompt_tokens * 4, 1)]
        out.append(Prompt([{"role": "user", "content": text}], text))
    return out


def load_prompt_file(path: str, n: int) -> list[Prompt]:
    """Prompts from a file, cycled to n requests.

    Plain text: one prompt per non-empty line. JSONL (or lines starting with '{' / '"'): a JSON
    string, or an object with "messages" (a chat), "prompt", "text", "content" or "question".
    """
    p = Path(path)
    if not p.is_file():
        raise EndpointBenchError(f"prompt file {path} does not exist")
    prompts: list[Prompt] = []
    for lineno, raw in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line[0] in "{\"[" or p.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise EndpointBenchError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            prompts.append(_prompt_from_json(obj, f"{path}:{lineno}"))
        else:
            prompts.append(Prompt([{"role": "user", "content": line}], line))
    if not prompts:
        raise EndpointBenchError(f"prompt file {path} has no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


def _prompt_from_json(obj: Any, where: str) -> Prompt:
    if isinstance(obj, str):
        return Prompt([{"role": "user", "content": obj}], obj)
    if isinstance(obj, dict):
        msgs = obj.get("messages")
        if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m for m in msgs):
            text = "\n".join(m["content"] for m in msgs if isinstance(m.get("content"), str))
            return Prompt(msgs, text)
        for key in ("prompt", "text", "content", "question", "input"):
            if isinstance(obj.get(key), str):
                return Prompt([{"role": "user", "content": obj[key]}], obj[key])
    raise EndpointBenchError(
        f"{where}: expected a JSON string or an object with messages/prompt/text, got {str(obj)[:80]}")


# --- token counting -----------------------------------------------------------------------------
def _encode(tok, text: str) -> list[int]:
    try:
        return list(tok.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tok.encode(text))


def _synthetic_dir(model: str | None) -> str | None:
    """The directory a `synthetic:` spec was built into, if it was (never builds one)."""
    if not model or not model.startswith("synthetic:"):
        return None
    try:
        from mlxlocal.source import synthetic

        path = synthetic.default_root() / synthetic.parse_spec(model).dirname
    except Exception:  # noqa: BLE001 - not a spec we know: no candidate
        return None
    return str(path) if (path / "config.json").is_file() else None


class TokenCounter:
    """Counts tokens when the server reports no usage: a transformers tokenizer if one loads
    (the `tokenizer` argument, else the model name from local files only), else chars / 4."""

    def __init__(self, tokenizer: str | None, model: str | None):
        self.spec, self.model = tokenizer, model
        self._tok: Any = None
        self._tried = False
        self.name: str | None = None
        self.load_error: str | None = None

    def load(self):
        if self._tried:
            return self._tok
        self._tried = True
        try:
            from transformers import AutoTokenizer
        except ImportError:
            self.load_error = "transformers is not installed"
            return None
        candidates = [(self.spec, False)] if self.spec else [(self.model, True)]
        built = _synthetic_dir(self.model) if not self.spec else None
        if built is not None:  # an mlxlocal server's synthetic:NAME, built on this machine
            candidates.append((built, True))
        for name, local_only in candidates:
            try:
                self._tok = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
                self.name = name
                break
            except Exception as e:  # noqa: BLE001 - any failure means "no tokenizer"
                self.load_error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if self._tok is None and self.spec:
            raise EndpointBenchError(f"cannot load tokenizer {self.spec!r}: {self.load_error}")
        return self._tok

    def count(self, text: str) -> tuple[int, str]:
        """(tokens, method) for `text`."""
        tok = self.load()
        if tok is not None:
            return len(_encode(tok, text)), f"tokenizer:{self.name}"
        return (math.ceil(len(text) / 4) if text else 0), "chars/4 estimate"
