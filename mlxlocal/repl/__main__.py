"""`python -m mlxlocal.repl --model SPEC`: the chat REPL without the Typer CLI."""

import sys

from mlxlocal.repl.chat import main

sys.exit(main())
