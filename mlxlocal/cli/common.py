"""What every command module of the CLI shares: the stderr console, `fail`, size and count
formatting, --kv-* and speculative (--draft-model, --prompt-lookup) option parsing and the
common help strings. It imports nothing else of the CLI, so command modules depend on it (and
convert on models), never on the package."""

from __future__ import annotations

import re
from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True, soft_wrap=True)  # never break a path across lines

MODEL_HELP = "Local HF-layout directory, catalog alias (models.toml), Hugging Face repo id, or synthetic:NAME"


def fail(message: str, code: int = 1) -> NoReturn:
    err.print("[bold red]error:[/] " + escape(message), highlight=False)  # user text verbatim
    raise typer.Exit(code)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def parse_size(text: str) -> int:
    """'4GB', '512MiB', '2g', '1000000' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m or float(m[1]) <= 0:
        raise typer.BadParameter(f"cannot read a positive size from {text!r} (e.g. 4GB, 512MiB, 2g)")
    return int(float(m[1]) * 1024 ** " kmgt".index(m[2] or " "))


def engine_options(kv_cache_memory: Optional[str], kv_blocks: Optional[int], block_size: int,
                   no_prefix_cache: bool, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                   kv_disk: Optional[str] = None, kv_disk_dir: Optional[Path] = None) -> dict:
    options: dict = {"block_size": block_size, "prefix_cache": not no_prefix_cache,
                     **kv_precision(kv_bits, kv_group_size)}
    if kv_disk_dir is not None and kv_disk is None:
        fail("--kv-disk-dir applies with --kv-disk only (the tier's size, e.g. --kv-disk 20GB)", 2)
    if kv_disk is not None:
        if no_prefix_cache:
            fail("--kv-disk is a tier under the prefix cache: it cannot go with --no-prefix-cache", 2)
        options["kv_disk"] = parse_size(kv_disk)
        if kv_disk_dir is not None:
            if kv_disk_dir.exists() and not kv_disk_dir.is_dir():
                fail(f"--kv-disk-dir {kv_disk_dir}: not a directory", 2)
            options["kv_disk_dir"] = str(kv_disk_dir)
    if kv_blocks is not None:
        if kv_blocks < 1:
            fail("--kv-blocks must be >= 1", 2)
        options["kv_blocks"] = kv_blocks
    if kv_cache_memory is not None:
        options["kv_memory"] = parse_size(kv_cache_memory)
    if block_size not in (8, 16, 32, 64):
        fail("--block-size must be one of 8, 16, 32, 64", 2)
    return options


def kv_precision(kv_bits: Optional[int], kv_group_size: int) -> dict:
    """--kv-bits / --kv-group-size as EngineConfig fields; exits 2 naming the option otherwise
    (the model's head_dim is checked when the engine is built)."""
    from mlxlocal.cache.quantized import KV_BITS, KV_GROUP_SIZES  # the pools' own rules

    if kv_bits is not None and kv_bits not in KV_BITS:
        fail(f"--kv-bits must be 8 or 4, not {kv_bits}", 2)
    if kv_group_size not in KV_GROUP_SIZES:
        fail(f"--kv-group-size must be 32, 64 or 128, not {kv_group_size}", 2)
    if kv_bits is None:
        if kv_group_size != 64:
            fail("--kv-group-size applies with --kv-bits only", 2)
        return {}
    return {"kv_bits": kv_bits, "kv_group_size": kv_group_size}


KV_DISK_HELP = ("Keep prefix KV blocks on disk too, up to this size (e.g. 20GB): they outlive restarts and "
                "evictions, and a prompt whose prefix is there is read back instead of recomputed")
KV_DISK_DIR_HELP = "With --kv-disk: where the block files go (default: $MLXLOCAL_HOME/kv)"
KERNELS_HELP = ("Decode kernels: auto (per op and shape, the faster of ours and MLX's built-in, timed once per chip "
                "and kept in $MLXLOCAL_HOME/kernel_choices.json), ours, or mlx (default: $MLXLOCAL_KERNELS or auto)")


def kernels_mode(value: Optional[str]) -> None:
    """--kernels (else MLXLOCAL_KERNELS) checked and put in place for this process; exits 2
    naming the option (or the variable) otherwise."""
    from mlxlocal.metal.dispatch import KernelModeError, mode, set_mode

    try:
        set_mode(value) if value is not None else mode()
    except KernelModeError as e:
        fail(str(e), 2)


KV_BITS_HELP = "Store the KV cache quantized to 8 or 4 bits (about 1/2 or 1/4 of the memory; default: model dtype)"
KV_GROUP_HELP = "With --kv-bits: elements sharing one scale and bias (32, 64, 128; must divide the head dim)"

KV_MEMORY_HELP = "Memory for the paged KV cache, e.g. 4GB (default: sized from the request, at most 15% of RAM)"


FREQ_HELP = "Lower a token's logit by this times its count in the reply so far, in [-2, 2]"
PRES_HELP = "Lower the logit of every token already in the reply by this, in [-2, 2]"


KV_COMPACT_HELP = ("Drop parts of the conversation from the KV cache as it grows (cache edits): "
                   "comma-separated keep-last-tool-outputs=K (older tool results leave the cache), drop-thinking "
                   "(old think blocks leave at the next user message), reposition (re-rotate the keys after a "
                   "gap to close it); the text the model was given stays, /stats shows what was dropped")


def compaction_policy(text: Optional[str]):
    """--kv-compact parsed; exits 2 naming the option and the bad part otherwise."""
    from mlxlocal.edits import parse_policy

    try:
        return parse_policy(text)
    except ValueError as e:
        fail(str(e), 2)


def duration_option(text: str, option: str, positive: bool = False) -> float:
    """A duration option (90, 30m, 1h; -1: never) in seconds; exits 2 naming the option."""
    from mlxlocal.server.errors import APIError
    from mlxlocal.server.registry import parse_duration

    try:
        seconds = parse_duration(text)
    except APIError as e:
        fail(e.message.replace("keep_alive", option), 2)
    assert seconds is not None  # parse_duration gives None only for None, and text is a str
    if positive and not seconds > 0:
        fail(f"{option}: must be a positive duration (or -1: never)", 2)
    return seconds


def agent_limits(max_steps: int, max_tools: str) -> int | None:
    """chat --mcp / run: --max-steps checked, --max-tools parsed (None: no pruning); exits 2
    naming the option otherwise."""
    from mlxlocal.agents.pruning import parse_max_tools

    if max_steps < 1:
        fail("--max-steps must be at least 1", 2)
    try:
        return parse_max_tools(max_tools)
    except ValueError as e:
        fail(str(e), 2)


DRAFT_MODEL_HELP = ("Speculative decoding with this draft model (any --model spec; it must share the model's "
                    "tokenizer): it drafts tokens, the model verifies them all in one forward. The draft may be "
                    "the model itself")
PROMPT_LOOKUP_HELP = ("Speculative decoding by prompt lookup: tokens drafted from n-gram matches in the prompt and "
                      "the reply so far (no extra model; pays off on text that repeats its input: code edits, JSON)")
NUM_DRAFT_HELP = "With --draft-model or --prompt-lookup: tokens drafted per step at most, 1..32 (default: 4)"
MTP_HELP = ("Multi-token prediction: draft with the model's own MTP modules (DeepSeek-V3/R1, GLM-4.5, "
            "Qwen3.5 checkpoints that keep them). auto: when the model has them (default); off; N: "
            "N draft tokens per step, 1..32 (auto drafts 3)")


def mtp_mode(value: Optional[str]) -> str | int | None:
    """--mtp's value: "auto", "off", a draft length, or None (not given); exits 2 otherwise."""
    if value is None:
        return None
    v = value.strip().lower()
    if v in ("auto", "off"):
        return v
    if not v.isdigit() or not 1 <= int(v) <= 32:
        fail(f"--mtp must be auto, off or a number of draft tokens in 1..32, got {value!r}", 2)
    return int(v)


def speculation(draft_model: Optional[str], prompt_lookup: bool, num_draft_tokens: Optional[int],
                options: Optional[dict] = None, mtp: Optional[str] = None):
    """--draft-model / --prompt-lookup / --mtp / --num-draft-tokens -> a SpeculationChoice (an
    engine option, put in `options` as "speculative" when given) or None; exits 2 naming the
    options when they do not go together. --mtp auto (its default where a command offers it)
    is a choice that applies only to models with MTP modules."""
    from mlxlocal.engine import DEFAULT_DRAFT_TOKENS, DEFAULT_MTP_TOKENS, SpeculationChoice

    mode = mtp_mode(mtp)
    if draft_model is not None and prompt_lookup:
        fail("--draft-model and --prompt-lookup: give one drafter, not both", 2)
    if isinstance(mode, int) and (draft_model is not None or prompt_lookup):
        fail("--mtp N and --draft-model / --prompt-lookup: give one drafter, not both", 2)
    if draft_model is None and not prompt_lookup:
        if num_draft_tokens is not None:
            fail("--num-draft-tokens needs a drafter: add --draft-model MODEL or --prompt-lookup "
                 "(--mtp N sets MTP's)", 2)
        if mode in (None, "off"):
            return None
        n = mode if isinstance(mode, int) else DEFAULT_MTP_TOKENS
        choice = SpeculationChoice("mtp", None, n, auto=mode == "auto")
        if options is not None:
            options["speculative"] = choice
        return choice
    n = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
    if not 1 <= n <= 32:
        fail(f"--num-draft-tokens must be in 1..32, got {n}", 2)
    if draft_model is not None and not draft_model.strip():
        fail("--draft-model: the model spec is empty", 2)
    choice = SpeculationChoice("draft" if draft_model is not None else "lookup", draft_model, n)
    if options is not None:
        options["speculative"] = choice
    return choice
