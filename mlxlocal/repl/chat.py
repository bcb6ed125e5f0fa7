"""`mlxlocal chat`: a terminal REPL over the engine (like `ollama run` / `mlx_lm.chat`).

Front end only: the terminal side (reading input, the slash commands, rendering) of one
`Conversation` (conversation.py), whose prompts hand token ids to `Engine.generate` on its
session; the reply streams as Markdown (view.py). A conversation keeps the token ids the
model saw and produced, so each new turn prefills only its new tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from rich.console import Console

from mlxlocal.agents.conversation import Conversation, Message, parse_saved
from mlxlocal.edits import CompactionPolicy
from mlxlocal.engine import (
    Engine,
    EngineSession,
    GenerationStats,
    SamplingParams,
    open_engine,
    speculation_of,
)
from mlxlocal.errors import ContextLengthError, MlxLocalError
from mlxlocal.repl.view import ReplyView, format_footer, human_count

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
COMMANDS = {
    "/help": "show this help",
    "/clear": "forget the conversation (and its cached tokens)",
    "/system TEXT": "set the system prompt (clears the conversation)",
    "/save FILE": "save the conversation as JSON",
    "/load FILE": "restore a conversation saved with /save",
    "/stats": "model info, attended and dropped tokens (--kv-compact), speculative acceptance, last reply's stats",
    "/model SPEC": "switch to another model",
    "/exit": "leave (also /quit, /bye, Ctrl-D)",
}
EXIT_COMMANDS = ("/exit", "/quit", "/bye")
DEFAULT_MAX_TOKENS = 1024  # a reply's length unless --max-tokens says otherwise
SYNTHETIC_MAX_TOKENS = 128  # ... on random weights


# --- small helpers (unit tested) ------------------------------------------------------
def default_history_file() -> Path:
    home = os.environ.get("MLXLOCAL_HOME")
    if home:
        return Path(home) / "chat_history"
    return Path.home() / ".local" / "state" / "mlxlocal" / "chat_history"


def block_is_open(text: str) -> bool:
    """True while the input is a `\"\"\"` block that has not seen its closing line."""
    lines = text.split("\n")
    return lines[0].strip() == BLOCK and (len(lines) == 1 or lines[-1].strip() != BLOCK)


def unwrap_block(text: str) -> str:
    """The body of a `\"\"\"` block; any other input unchanged."""
    lines = text.split("\n")
    if lines[0].strip() != BLOCK:
        return text
    body = lines[1:]
    if body and body[-1].strip() == BLOCK:
        body = body[:-1]
    return "\n".join(body)


@contextlib.contextmanager
def sigint_sets(event: threading.Event) -> Iterator[None]:
    """While generating, Ctrl-C stops the reply (sets `event`) instead of raising."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield
    finally:
        # None means a handler installed outside Python: the default is the closest we can restore.
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def quiet_keys() -> Iterator[None]:
    """While a reply streams, keys typed are neither echoed into it (nor is Ctrl-C's ^C, which
    would throw off the live view's redraw) nor lost: they wait, unread, for the next prompt."""
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd) if sys.stdin.isatty() else None
    except (ImportError, OSError, ValueError, AttributeError):  # no terminal: nothing to do
        saved = None
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ICANON | getattr(termios, "ECHOCTL", 0))  # ISIG stays
    quiet[3] |= termios.NOFLSH  # Ctrl-C must not discard what was typed ahead
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)  # NOW, not FLUSH: type-ahead is kept


# --- the REPL ---------------------------------------------------------------------------
class ChatRepl:
    """The terminal around one Conversation (`self.conv`): input, commands, rendering."""

    def __init__(self, engine: Engine, console: Console, *, system: str | None = None,
                 params: SamplingParams | None = None, history: History | None = None,
                 engine_options: dict | None = None, compact: CompactionPolicy | None = None,
                 conversation: Conversation | None = None):
        # `conversation`: one shared with another owner (AgentRepl's ToolLoop); else a new one.
        self.conv = conversation or Conversation(engine, system=system, compact=compact)
        self.engine_options = engine_options or {}
        self.console = console
        self.params = params or SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
        self.last_stats: GenerationStats | None = None
        self.history = history or InMemoryHistory()
        self._prompt: PromptSession[str] | None = None

    @property
    def engine(self) -> Engine:
        return self.conv.engine

    @property
    def session(self) -> EngineSession:
        return self.conv.session

    # output helpers: user text (errors, file names) must never be read as Rich markup
    def say(self, text: str, style: str | None = None) -> None:
        # Off a terminal, leave long lines whole (logs, pipes) instead of wrapping at 80 columns.
        self.console.print(text, style=style, markup=False, highlight=False,
                           soft_wrap=not self.console.is_terminal)

    def error(self, text: str) -> None:
        self.say(f"error: {text}", "red")

    def banner(self) -> None:
        info = self.engine.info
        self.say(f"mlxlocal chat · {info.name} · {human_count(info.n_params)} params · "
                 f"quantization {info.quantization} · context {info.context_length} tokens", "bold")
        if info.source == "synthetic":
            from mlxlocal.source.synthetic import is_trained

            what = ("trained here on synthetic text: replies are that kind of text"
                    if is_trained(info.path) else "random weights: replies are gibberish on purpose")
            self.say(f"{what} (the speed is real); they stop at {self.params.max_tokens} tokens "
                     "(--max-tokens)", "yellow")
        self.say(f'Type /help for commands. Esc+Enter or a {BLOCK} line for multi-line input; '
                 "Ctrl-C stops a reply, Ctrl-D exits.", "dim")

    # input ----------------------------------------------------------------------------
    def _prompt_session(self) -> PromptSession[str]:
        if self._prompt is None:
            keys = KeyBindings()

            @keys.add("escape", "enter")  # Alt+Enter arrives as Esc, Enter
            def _newline(event: Any) -> None:
                event.current_buffer.insert_text("\n")

            @keys.add("enter")
            def _enter(event: Any) -> None:
                buffer = event.current_buffer
                if block_is_open(buffer.text):  # inside a """ block Enter adds a line
                    buffer.insert_text("\n")
                else:
                    buffer.validate_and_handle()

            self._prompt = PromptSession(history=self.history, key_bindings=keys,
                                         prompt_continuation=CONTINUATION)
        return self._prompt

    def read(self) -> str | None:
        """One user input (a whole \"\"\" block counts as one); None at end of input."""
        if not sys.stdin.isatty():  # piped input: plain lines, no line editor
            lines: list[str] = []
            try:
                lines.append(input())
                while block_is_open("\n".join(lines)):
                    lines.append(input())
            except EOFError:
                if not lines:
                    return None
            return unwrap_block("\n".join(lines))
        while True:
            try:
                return unwrap_block(self._prompt_session().prompt(PROMPT))
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt clears the line, like a shell
            except EOFError:
                return None

    def run(self) -> int:
        self.banner()
        while True:
            text = self.read()
            if text is None:
                return 0
            if not text.strip():
                continue
            try:
                if text.lstrip().startswith("/"):
                    if not self.command(text.strip()):
                        return 0
                else:
                    self.turn(text)
            except KeyboardInterrupt:  # a Ctrl-C outside generation (e.g. during /model)
                self.say("[interrupted]", "yellow")

    # commands ---------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a slash command; False means leave the REPL."""
        name, _, arg = line.partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in EXIT_COMMANDS:
            return False
        handlers = {
            "/help": self.cmd_help, "/clear": self.cmd_clear, "/system": self.cmd_system,
            "/save": self.cmd_save, "/load": self.cmd_load, "/stats": self.cmd_stats,
            "/model": self.cmd_model,
        }
        handler = handlers.get(name)
        if handler is None:
            names = " ".join(c.split()[0] for c in COMMANDS)
            self.error(f"unknown command {name}. Commands: {names}")
        else:
            handler(arg)
        return True

    def cmd_help(self, arg: str) -> None:
        for usage, what in COMMANDS.items():
            self.say(f"  {usage:<14} {what}")
        self.say(f'  Multi-line input: Esc+Enter (or Alt+Enter) for a new line, or wrap it in {BLOCK} '
                 "lines. Ctrl-C stops a reply; Ctrl-D exits.", "dim")

    def reset(self) -> None:
        self.conv.reset()  # drops the KV too: nothing left to reuse

    def cmd_clear(self, arg: str) -> None:
        self.reset()
        self.say("conversation cleared", "dim")

    def cmd_system(self, arg: str) -> None:
        if not arg:
            system = self.conv.system
            self.say(f"system prompt: {system!r}" if system else "no system prompt")
            self.say("usage: /system TEXT", "dim")
            return
        self.conv.system = arg
        self.reset()
        self.say("system prompt set; conversation cleared", "dim")

    def cmd_save(self, arg: str) -> None:
        if not arg:
            return self.error("usage: /save FILE")
        path = Path(arg).expanduser()
        data = self.conv.to_saved()
        try:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as e:
            return self.error(f"cannot write {path}: {e.strerror or e}")
        self.say(f"saved {len(data['messages'])} messages to {path}", "dim")

    def cmd_load(self, arg: str) -> None:
        if not arg:
            return self.error("usage: /load FILE")
        path = Path(arg).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            parse_saved(data)  # a file that is no saved chat leaves the conversation as it was
        except FileNotFoundError:
            return self.error(f"no such file: {path}")
        except (OSError, UnicodeDecodeError) as e:
            return self.error(f"cannot read {path}: {e}")
        except ValueError as e:  # json.JSONDecodeError is a ValueError too
            return self.error(f"{path} is not a saved chat: {e}")
        self.reset()  # AgentRepl's also starts its tool loop and policy over
        self.conv.from_saved(data)
        self.say(f"loaded {len(self.conv.messages)} messages from {path}", "dim")

    def cmd_stats(self, arg: str) -> None:
        info = self.engine.info
        path = "native" if info.native else "mlx-lm"
        self.say(f"model    {info.name} ({info.model_type}, {path}), {human_count(info.n_params)} "
                 f"params, quantization {info.quantization}, {info.dtype}, "
                 f"context {info.context_length} tokens")
        self.say(f"weights  {info.weights.describe()}")
        self.say(f"session  {self.session.cached_len} tokens attended (in the KV cache), "
                 f"{self.session.dropped_len} dropped, {len(self.conv.ids)} conversation tokens, "
                 f"{len(self.conv.messages)} messages")
        st = self.engine.stats()
        spans = self.conv.spans
        policy = spans.policy
        if policy.active:
            self.say(f"compact  {policy.describe()}: engine {st['tokens_dropped']} tokens dropped, "
                     f"{st['tokens_repositioned']} repositioned"
                     + (f" · last reply {self.last_stats.dropped_tokens} prompt tokens not attended"
                        if self.last_stats else "")
                     + (f" · {spans.note}" if spans.note else ""))
        pool = self.engine.kv_pool
        if pool["kind"] == "paged":
            bits = f"K/V {pool['kv_bits']}-bit, " if pool.get("kv_bits") else ""
            self.say(f"kv cache {st['blocks_used']}/{st['blocks_total']} blocks of {st['block_size']} tokens "
                     f"in use, {st['blocks_cached']} cached for reuse, {bits}"
                     f"{st['prefix_hit_tokens']} prompt tokens served from cache")
        else:  # dense caches: no blocks to count
            self.say(f"kv cache dense, one per session (mlx-lm path), "
                     f"{st['prefix_hit_tokens']} prompt tokens served from cache")
        spec = speculation_of(self.engine_options)
        if spec is not None and (not spec.auto or st["spec_drafted"]):  # auto: a model with MTP
            drafted, accepted = st["spec_drafted"], st["spec_accepted"]
            rate = f"{accepted / drafted:.0%}" if drafted else "nothing drafted yet"
            self.say(f"speculate {spec.describe()}: {accepted} of {drafted} drafted tokens accepted ({rate}) "
                     f"in {st['spec_steps']} verify steps")
        self.say(f"last     {format_footer(self.last_stats) if self.last_stats else 'no reply yet'}")

    def cmd_model(self, arg: str) -> None:
        if not arg:
            return self.error("usage: /model SPEC")
        from mlxlocal.source.loader import load

        try:
            with self.console.status(f"loading {arg}…"):
                engine = open_engine(load(arg), **self.engine_options)
        except MlxLocalError as e:
            return self.error(f"{e} (still using {self.engine.info.name})")
        except Exception as e:  # a failed switch must not end the chat
            return self.error(f"{type(e).__name__}: {e} (still using {self.engine.info.name})")
        self.engine.shutdown()  # free the old model's engine thread and KV pools
        self.conv.switch_engine(engine)  # another tokenizer: the next turn re-encodes the text
        self.banner()

    # a chat turn ------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        user: Message = {"role": "user", "content": text}
        cancel = threading.Event()
        stats: GenerationStats | None = None
        generated: list[int] = []
        try:
            prompt = self.conv.prompt_ids(user)
            edits = self.conv.edits(user)
            extra = {"edits": edits} if edits is not None else {}  # no policy: no edits at all
            with sigint_sets(cancel), quiet_keys(), ReplyView(self.console) as view:
                for chunk in self.engine.generate(prompt, self.params, session=self.session, cancel=cancel,
                                                  **extra):
                    if chunk.token is not None:
                        generated.append(chunk.token)
                    generated += chunk.written  # a thinking budget's marker: the model saw it
                    if chunk.text:
                        view.add(chunk.text)
                    if chunk.stats is not None:
                        stats = chunk.stats
        except ContextLengthError as e:
            return self.error(f"{e}. Use /clear to start a new conversation.")
        except ValueError as e:  # e.g. an engine that cannot edit its cache (--kv-compact)
            return self.error(str(e))
        if stats is not None and stats.finish_reason == "cancelled" and not generated:
            # Nothing to continue from: forget the turn as if it was never sent.
            return self.say("cancelled before the first token", "yellow")
        # Keep even a cut-off reply: the next turn then continues from what the user saw.
        self.conv.record(user, view.text, prompt, generated)
        if stats is None:
            return
        self.last_stats = stats
        if stats.finish_reason == "cancelled":
            self.say("[interrupted]", "yellow")
        self.say(format_footer(stats), "dim")


def compact_refusal(engine: Engine, compact: CompactionPolicy | None) -> str | None:
    """Why --kv-compact cannot work on this engine (said before the first turn, not at the
    first drop), or None."""
    pool = engine.kv_pool
    if compact is None or not compact.active or pool.get("kind") == "paged":
        return None
    return (f"--kv-compact needs the paged KV cache; {engine.info.name} runs on a dense cache "
            f"({pool.get('reason') or 'not pageable'})")


def refuse_compaction(engine: Engine, compact: CompactionPolicy | None, say: Callable[[str], None]) -> bool:
    """compact_refusal said as an error, the engine shut down; True when refused."""
    refusal = compact_refusal(engine, compact)
    if refusal:
        engine.shutdown()
        say(f"error: {refusal}")
    return refusal is not None


def _history(path: Path) -> History:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
        return FileHistory(str(path))
    except OSError:
        return InMemoryHistory()  # e.g. a read-only home: chat still works, without history


def run_chat(model: str, *, system: str | None = None, params: SamplingParams | None = None,
             history_file: Path | None = None, console: Console | None = None,
             engine_options: dict | None = None, compact: CompactionPolicy | None = None,
             max_tokens_given: bool = True) -> int:
    """Load `model` and run the REPL until /exit or Ctrl-D; return the exit code.

    engine_options are EngineConfig fields (KV pool size, block size, prefix cache). Without
    max_tokens_given, a synthetic model's replies stop at SYNTHETIC_MAX_TOKENS.
    """
    from mlxlocal.source.loader import load

    console = console or Console()
    # One conversation at a time: size the KV pool for one full context by default.
    engine_options = {"max_num_seqs": 1, **(engine_options or {})}
    try:
        with console.status(f"loading {model}…"):
            engine = open_engine(load(model), **engine_options)
    except MlxLocalError as e:
        console.print(f"error: {e}", style="bold red", markup=False, highlight=False)
        return 1
    except KeyboardInterrupt:
        return 130
    params = params or SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)
    if not max_tokens_given and engine.info.source == "synthetic":  # minutes of gibberish otherwise
        params.max_tokens = SYNTHETIC_MAX_TOKENS
    if refuse_compaction(engine, compact,
                         lambda text: console.print(text, style="bold red", markup=False, highlight=False)):
        return 2
    history = _history(history_file or default_history_file())
    return ChatRepl(engine, console, system=system, params=params, history=history,
                    engine_options=engine_options, compact=compact).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxlocal.repl", description=__doc__.splitlines()[0])
    parser.add_argument("--model", "-m", required=True)
    parser.add_argument("--system")
    parser.add_argument("--max-tokens", "-n", type=int, default=None)
    parser.add_argument("--thinking-budget", type=int)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--history-file", type=Path)
    parser.add_argument("--kv-compact", default=None)
    args = parser.parse_args(argv)
    from mlxlocal.edits import parse_policy

    try:
        compact = parse_policy(args.kv_compact)
    except ValueError as e:
        parser.error(str(e))
    n = DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    params = SamplingParams(max_tokens=n, temperature=args.temp, top_p=args.top_p, seed=args.seed,
                            think_budget=args.thinking_budget)
    try:
        params.validate()
    except ValueError as e:
        parser.error(str(e))
    return run_chat(args.model, system=args.system, params=params, history_file=args.history_file,
                    compact=compact, max_tokens_given=args.max_tokens is not None)
