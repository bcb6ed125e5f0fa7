"""The `mlxlocal` command line (Typer). Front end only: it talks to the loader and the engine."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from mlxlocal import __version__
from mlxlocal.errors import MlxLocalError

app = typer.Typer(
    name="mlxlocal",
    help="Local LLM inference on Apple Silicon, built on MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, soft_wrap=True)  # never break a path across lines

MODEL_HELP = "Local HF-layout directory, catalog alias (models.toml), Hugging Face repo id, or synthetic:NAME"


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
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
                   no_prefix_cache: bool) -> dict:
    options: dict = {"block_size": block_size, "prefix_cache": not no_prefix_cache}
    if kv_blocks is not None:
        if kv_blocks < 1:
            fail("--kv-blocks must be >= 1", 2)
        options["kv_blocks"] = kv_blocks
    if kv_cache_memory is not None:
        options["kv_memory"] = parse_size(kv_cache_memory)
    if block_size not in (8, 16, 32, 64):
        fail("--block-size must be one of 8, 16, 32, 64", 2)
    return options


KV_MEMORY_HELP = "Memory for the paged KV cache, e.g. 4GB (default: sized from the request, at most 15% of RAM)"


FREQ_HELP = "Lower a token's logit by this times its count in the reply so far, in [-2, 2]"
PRES_HELP = "Lower the logit of every token already in the reply by this, in [-2, 2]"


@app.command()
def generate(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text; '-' or omitted reads stdin"),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum tokens to generate"),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 disables top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help=FREQ_HELP),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help=PRES_HELP),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)"),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt"),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Encode the prompt as plain text"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help=KV_MEMORY_HELP),
    kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="KV pool size in blocks"),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block"),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Disable the radix prefix cache"),
) -> None:
    """Generate a completion for one prompt, streamed to the terminal."""
    from mlxlocal.engine import SamplingParams, open_engine
    from mlxlocal.engine.base import EngineBase
    from mlxlocal.loader import load

    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            fail("no prompt: pass --prompt or pipe text on stdin", 2)
        prompt = sys.stdin.read()
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed, stop=list(stop), ignore_eos=ignore_eos,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
    )
    try:
        params.validate()
    except ValueError as e:
        fail(str(e), 2)
    options = engine_options(kv_cache_memory, kv_blocks, block_size, no_prefix_cache)
    try:
        loaded = load(model)
        prompts = EngineBase(loaded)
        if no_chat_template:
            text = (system + "\n\n" + prompt) if system else prompt
            ids = prompts.encode_text(text)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = prompts.encode_chat(messages)
        # One request: a pool just big enough for it, unless told otherwise.
        options.setdefault("kv_tokens", len(ids) + max_tokens)
        engine = open_engine(loaded, max_num_seqs=1, **options)
        pieces: list[str] = []
        tokens: list[int] = []
        stats = None
        for chunk in engine.generate(ids, params):
            pieces.append(chunk.text)
            if chunk.token is not None:
                tokens.append(chunk.token)
            if chunk.stats is not None:
                stats = chunk.stats
            if not as_json and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except MlxLocalError as e:
        fail(str(e))
    assert stats is not None
    synthetic = engine.info.source == "synthetic"
    if as_json:
        result = {"model": engine.info.name, "text": "".join(pieces), "tokens": tokens, **stats.as_dict(),
                  "synthetic": synthetic}
        print(json.dumps(result))
        return
    sys.stdout.write("\n")
    err.print(stats_line(stats, engine.context_length), style="dim", highlight=False, markup=False)
    if synthetic:
        err.print("(random weights: the text is gibberish on purpose; the numbers above are the "
                  "real speed of this model shape)", style="dim", highlight=False, markup=False)


def stats_line(stats, context_length: int) -> str:
    """The footer under a reply: every number labelled, and why a "length" finish happened."""
    finish = stats.finish_reason or "unknown"
    why = {"max_tokens": "max tokens", "context": f"context full: {context_length} tokens",
           "kv_cache": "KV cache full: raise --kv-cache-memory"}.get(stats.truncated_by)
    if why:
        finish += f" ({why})"
    return (f"prompt {stats.prompt_tokens} tokens ({stats.cached_tokens} cached), {stats.prefill_tps:.1f} tok/s"
            f" · reply {stats.completion_tokens} tokens, {stats.decode_tps:.1f} tok/s"
            f" · TTFT {stats.ttft_s * 1000:.0f} ms · peak memory {human_bytes(stats.peak_memory_bytes)}"
            f" · finish: {finish}")


@app.command()
def chat(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt"),
    max_tokens: int = typer.Option(1024, "--max-tokens", "-n"),
    temp: float = typer.Option(0.0, "--temp"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help=FREQ_HELP),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help=PRES_HELP),
    seed: Optional[int] = typer.Option(None, "--seed"),
    history_file: Optional[Path] = typer.Option(None, "--history-file", help="Input history (default under ~/.local/state/mlxlocal)"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help=KV_MEMORY_HELP),
    kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="KV pool size in blocks"),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block"),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Disable the radix prefix cache"),
) -> None:
    """Chat with a model in the terminal (Markdown streaming, history, /help for commands)."""
    from mlxlocal.chat import run_chat
    from mlxlocal.engine import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
    )
    try:
        params.validate()
    except ValueError as e:
        fail(str(e), 2)
    options = engine_options(kv_cache_memory, kv_blocks, block_size, no_prefix_cache)
    raise typer.Exit(run_chat(model, system=system, params=params, history_file=history_file,
                              engine_options=options))


@app.command()
def show(model: str = typer.Argument(..., help=MODEL_HELP)) -> None:
    """Load a model and print its architecture, size, quantization and how it was loaded."""
    from mlxlocal.loader import load

    try:
        loaded = load(model)
    except MlxLocalError as e:
        fail(str(e))
    info, cfg = loaded.info, loaded.model_config
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan")
    table.add_column()
    rows = [
        ("model", info.name),
        ("source", f"{info.source}: {info.path}"),
        ("architecture", f"{info.model_type} ({'native mlxlocal' if info.native else 'mlx-lm compatibility path'})"),
        ("parameters", f"{human_count(info.n_params)} ({info.n_params:,})"),
        ("quantization", info.quantization),
        ("dtype", info.dtype),
        ("context length", f"{info.context_length:,}"),
    ]
    if cfg is not None:
        rows += [
            ("layers", str(cfg.num_hidden_layers)),
            ("hidden / intermediate", f"{cfg.hidden_size} / {cfg.intermediate_size}"),
            ("heads (q / kv) x dim", f"{cfg.num_attention_heads} / {cfg.num_key_value_heads} x {cfg.head_dim}"),
            ("vocab", f"{cfg.vocab_size:,}"),
            ("rope", f"theta {cfg.rope_theta:g}" + (f", {cfg.rope_scaling['rope_type']} x{cfg.rope_scaling.get('factor')}" if cfg.rope_scaling else "")),
            ("tied embeddings", str(cfg.tie_word_embeddings).lower()),
        ]
        if cfg.sliding_window:
            rows.append(("sliding window", f"{cfg.sliding_window} ({cfg.layer_types.count('sliding_attention')} layers)"))
    for name, size in info.weights.files:
        rows.append(("file", f"{name}  {human_bytes(size)}"))
    rows += [
        ("weights", f"{human_bytes(info.weights.total_bytes)} in {len(info.weights.files)} file(s), {info.weights.n_tensors} tensors"),
        ("loaded by", info.weights.load_path),
        ("load time", f"{info.load_seconds:.2f} s"),
    ]
    rows += [("note", note) for note in info.notes]
    for row in rows:
        table.add_row(*row)
    Console().print(table)


@app.command()
def serve(
    model: list[str] = typer.Option(..., "--model", "-m", help=MODEL_HELP + " (repeatable: serve several)"),
    served_model_name: list[str] = typer.Option(
        [], "--served-model-name", help="Name clients use for the model (repeatable). With one --model, every "
        "name is accepted and the first is the id listed (/v1/models, /api/tags); with several --model, give "
        "exactly one per --model, in the same order. The --model value stays accepted too."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: this machine only)"),
    port: int = typer.Option(8080, "--port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MLXLOCAL_API_KEY",
                                          help="Require this key (Bearer or x-api-key) on every route but /health"),
    allow_origin: list[str] = typer.Option([], "--allow-origin", help="Browser origin allowed besides localhost (repeatable; * for any)"),
    allow_host: list[str] = typer.Option(
        [], "--allow-host", help="Host header accepted besides loopback names (repeatable; * for any). On a "
        "loopback bind only loopback names are accepted otherwise (DNS-rebinding defence); on other addresses "
        "any host unless this is given"),
    keep_alive: str = typer.Option("-1", "--keep-alive", help="Unload a model after this idle time (5m, 1h; -1 never)"),
    max_body: str = typer.Option("8MB", "--max-body", help="Largest request body"),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests allowed to wait; more get 429"),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Sequences decoded together"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help=KV_MEMORY_HELP),
    kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="KV pool size in blocks"),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block"),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Disable the radix prefix cache"),
) -> None:
    """Serve OpenAI-, Anthropic- and Ollama-compatible APIs (binds 127.0.0.1 by default)."""
    from mlxlocal.server import ServerConfig
    from mlxlocal.server.banner import run_server
    from mlxlocal.server.errors import APIError
    from mlxlocal.server.registry import assign_names, parse_duration

    options = engine_options(kv_cache_memory, kv_blocks, block_size, no_prefix_cache)
    options.update(max_num_seqs=max_num_seqs, max_waiting=max_queue)
    try:
        keep = parse_duration(keep_alive)
    except APIError as e:
        fail(e.message.replace("keep_alive", "--keep-alive"), 2)
    try:
        assign_names(list(model), list(served_model_name))
    except ValueError as e:
        fail(str(e), 2)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        err.print(f"[yellow]warning:[/] listening on {host} without --api-key: anyone who can reach "
                  "this address can use the models", highlight=False)
    config = ServerConfig(models=list(model), host=host, port=port, api_key=api_key,
                          allowed_origins=list(allow_origin), max_body_bytes=parse_size(max_body),
                          keep_alive=keep, engine_options=options, served_model_names=list(served_model_name),
                          allowed_hosts=list(allow_host))
    if not run_server(config, err):
        raise typer.Exit(1)


@app.command()
def version() -> None:
    """Print versions of mlxlocal, MLX and mlx-lm."""
    import mlx.core as mx
    import mlx_lm

    metal = mx.metal.is_available()
    print(f"mlxlocal {__version__}\nmlx {mx.__version__} ({'Metal' if metal else 'CPU backend'})\nmlx-lm {mlx_lm.__version__}")


def _register_commands() -> None:
    from mlxlocal import cli_bench, cli_convert, cli_models, cli_quant

    cli_models.register(app)
    cli_bench.register(app)
    cli_convert.register(app)
    cli_quant.register(app)


_register_commands()


def main() -> None:
    try:
        app()
    except MlxLocalError as e:  # anything a command did not catch itself
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # a bug of ours: one line by default, the traceback on request
        if os.environ.get("MLXLOCAL_DEBUG"):
            raise
        err.print(f"[bold red]internal error:[/] {type(e).__name__}: {e} (MLXLOCAL_DEBUG=1 for the traceback)", highlight=False)
        sys.exit(3)


if __name__ == "__main__":
    main()
