"""`mlxlocal launch-cluster`: one mlxlocal command as N ranks (tensor parallel over them).

The logic lives in mlxlocal.distributed (processes.py); this module is the command's options and errors."""

from __future__ import annotations

import os
from typing import Optional

import typer

from mlxlocal.cli.common import fail

HELP = """Run an mlxlocal command on N ranks of MLX's ring backend, the model split across them
(tensor parallel). Rank 0 runs the command (terminal, HTTP); the others follow its steps.

  mlxlocal launch-cluster -n 2 -- serve -m qwen3-8b
  mlxlocal launch-cluster -n 2 --pp -- generate -m qwen3-8b -p "hi"
  mlxlocal launch-cluster --hostfile hosts.json -- chat -m qwen3-32b

-n starts the ranks on this machine (loopback); --hostfile runs them on several Macs
through mlx.launch (see `mlx.distributed_config` to write one)."""


def register(app: typer.Typer) -> None:
    @app.command("launch-cluster", help=HELP,
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def launch_cluster(
        ctx: typer.Context,
        ranks: Optional[int] = typer.Option(None, "-n", "--ranks", "--tp", help="Ranks on this machine (loopback); "
                                            "the model is split across them by heads (tensor parallel)"),
        pp: bool = typer.Option(False, "--pp", help="Split the model by layers instead (pipeline parallel: "
                                "one range of layers per rank; for slow links)"),
        hostfile: Optional[str] = typer.Option(None, "--hostfile", help="mlx.launch hostfile (several machines)"),
        python: Optional[str] = typer.Option(None, "--python", help="Python to run the ranks with"),
    ) -> None:
        from mlxlocal import distributed as cluster

        argv = list(ctx.args)
        if not argv:
            fail("launch-cluster needs the command to run after --, e.g. `-- serve -m MODEL`", 2)
        if argv[0] == "launch-cluster":
            fail("launch-cluster cannot launch itself", 2)
        if (ranks is None) == (hostfile is None):
            fail("give either -n N (ranks on this machine) or --hostfile FILE", 2)
        if ranks is not None and ranks < 2:
            fail(f"-n must be at least 2 (got {ranks})", 2)
        # MLXLOCAL_PP under --pp: read by every rank's loader (models are split by layers)
        if ranks is None:
            assert hostfile is not None  # exactly one of -n and --hostfile (checked above)
            if pp:
                try:
                    os.environ["MLXLOCAL_PP"] = str(cluster.hosts_in(hostfile))
                except ValueError as e:
                    fail(str(e), 2)
            code = cluster.run_hosts(hostfile, argv, python)
        else:
            if pp:
                os.environ["MLXLOCAL_PP"] = str(ranks)
            code = cluster.run_local(ranks, argv, python)
        raise typer.Exit(code)
