# ruff: noqa: I001  (lazy_rich must be imported before typer)
"""The `mlxlocal` command line (Typer). Front end only: it talks to the loader and the engine.

One module per command group, each adding its commands with `register(app)`:
generate.py (generate, chat), agent.py (run), models.py (show, pull, list, rm), serve.py,
mcp_serve.py (mcp serve), embed.py, launch.py, cluster.py (launch-cluster), bench.py, convert.py, quant.py (quantize, perplexity), tools.py
(the `tools` group: check); common.py holds what they share.
"""

from __future__ import annotations

import os
import sys

# First: typer's help renderer imports parts of rich that --help never draws (lazy_rich.py).
from mlxlocal.cli import lazy_rich  # noqa: F401  (installs its stand-ins on import)
import typer
from rich.markup import escape

from mlxlocal import __version__
from mlxlocal.cli import (
    agent,
    bench,
    cache,
    cluster,
    convert,
    embed,
    generate,
    launch,
    mcp_serve,
    models,
    quant,
    serve,
    tools,
)

# Re-exported: `mlxlocal.cli.fail` etc. stay importable from the package as before the split.
from mlxlocal.cli.common import (  # noqa: F401
    MODEL_HELP,
    engine_options,
    err,
    fail,
    human_bytes,
    human_count,
    parse_size,
)
from mlxlocal.cli.generate import stats_line  # noqa: F401
from mlxlocal.errors import MlxLocalError

app = typer.Typer(
    name="mlxlocal",
    help="Local LLM inference on Apple Silicon, built on MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def version() -> None:
    """Print versions of mlxlocal, MLX and mlx-lm."""
    import mlx.core as mx
    import mlx_lm

    metal = mx.metal.is_available()
    mlx_version = mx.__version__  # type: ignore[attr-defined]  # mlx.core's stubs omit it
    print(f"mlxlocal {__version__}\nmlx {mlx_version} ({'Metal' if metal else 'CPU backend'})"
          f"\nmlx-lm {mlx_lm.__version__}")


# Registration order is the order `mlxlocal --help` lists the commands in.
generate.register(app)
agent.register(app)
embed.register(app)
models.register(app)
serve.register(app)
cache.register(app)
mcp_serve.register(app)
launch.register(app)
cluster.register(app)
app.command()(version)
bench.register(app)
convert.register(app)
quant.register(app)
tools.register(app)


def main() -> None:
    try:
        _main()
    finally:
        if "mlxlocal.distributed.channel" in sys.modules:  # rank 0 of a launch: the followers exit too
            if not sys.modules["mlxlocal.distributed.channel"].release():
                # A rank is gone or stuck: a thread of ours may wait in a collective forever,
                # so end now, with the command's own exit status.
                ending = sys.exc_info()[1]
                code = ending.code if isinstance(ending, SystemExit) else (1 if ending else 0)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
        # MLX asks every thread that used it, the main one too, to clear its streams before
        # the interpreter ends, or the process may abort at exit.
        if "mlx.core" in sys.modules:
            sys.modules["mlx.core"].clear_streams()


def _main() -> None:
    if os.environ.get("MLX_RANK", "0") != "0":
        # A rank other than 0 of a launch (mlx.launch, launch-cluster): no front end of its
        # own, it repeats rank 0's steps on its shard of the model until rank 0 exits.
        from mlxlocal.distributed import follower_main

        sys.exit(follower_main())
    try:
        app()
    except MlxLocalError as e:  # anything a command did not catch itself
        err.print("[bold red]error:[/] " + escape(str(e)), highlight=False)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # a bug of ours: one line by default, the traceback on request
        if os.environ.get("MLXLOCAL_DEBUG"):
            raise
        err.print("[bold red]internal error:[/] " + escape(f"{type(e).__name__}: {e}")
                  + " (MLXLOCAL_DEBUG=1 for the traceback)", highlight=False)
        sys.exit(3)


if __name__ == "__main__":
    main()
