"""What the REPLs show: a streaming reply as Markdown, the stats footer, counts and times."""

from __future__ import annotations

import time

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.markdown import Markdown
from rich.segment import Segment
from rich.text import Text

from mlxlocal.engine import GenerationStats
from mlxlocal.units import human_bytes

REFRESH_S = 0.25  # re-render Markdown 4x a second, not per token: parsing it is not free


def human_count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def format_seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def format_rate(tps: float) -> str:
    return f"{tps:.0f}" if tps >= 100 else f"{tps:.1f}"


def format_footer(stats: GenerationStats) -> str:
    parts = [
        f"decode {format_rate(stats.decode_tps)} tok/s",
        f"prefill {format_rate(stats.prefill_tps)} tok/s",
        f"prompt {stats.prompt_tokens} tokens ({stats.cached_tokens} cached"
        + (f", {stats.disk_tokens} from disk" if stats.disk_tokens else "")
        + (f", {stats.dropped_tokens} dropped from the KV cache)" if stats.dropped_tokens else ")"),
        f"reply {stats.completion_tokens} tokens"
        + (f" ({stats.accepted_tokens}/{stats.draft_tokens} drafted accepted)" if stats.draft_tokens else ""),
        f"TTFT {format_seconds(stats.ttft_s)}",
        f"peak {human_bytes(stats.peak_memory_bytes)}",
    ]
    if stats.finish_reason and stats.finish_reason != "stop":
        finish = f"finish: {stats.finish_reason}"
        if stats.finish_reason == "length" and stats.truncated_by == "context":
            finish += " (context full)"
        parts.append(finish)
    return " · ".join(parts)


class _Tail:
    """Markdown cut to its last screenful: a Live region cannot scroll, so show the newest text."""

    def __init__(self, text: str):
        self.markdown = Markdown(text)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        lines = console.render_lines(self.markdown, options.update(height=None), pad=False)
        for line in lines[-max(console.size.height - 2, 1):]:
            yield from line
            yield Segment.line()


class ReplyView:
    """Shows a streaming reply: Markdown in a Live region on a terminal, plain text otherwise."""

    def __init__(self, console: Console):
        self.console = console
        self.parts: list[str] = []
        self.live: Live | None = None
        self.last_refresh = 0.0

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def __enter__(self) -> ReplyView:
        if self.console.is_terminal:
            self.live = Live(Text("…", style="dim"), console=self.console, auto_refresh=False,
                             transient=True, vertical_overflow="visible")
            self.live.start(refresh=True)
        return self

    def add(self, text: str) -> None:
        self.parts.append(text)
        if self.live is None:
            self.console.file.write(text)
            self.console.file.flush()
        elif time.monotonic() - self.last_refresh >= REFRESH_S:
            self.live.update(_Tail(self.text), refresh=True)
            self.last_refresh = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()  # transient: clears the cropped view, then print the reply in full
            if self.text.strip():
                self.console.print(Markdown(self.text))
        elif self.parts:
            self.console.file.write("\n")
            self.console.file.flush()
