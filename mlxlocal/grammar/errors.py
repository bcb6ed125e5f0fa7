"""The error every grammar builder raises."""

from __future__ import annotations

from mlxlocal.errors import MlxLocalError


class GrammarError(MlxLocalError):
    """A schema or grammar that cannot be enforced; `param` is the request field it came from
    (the server answers 400 naming it, before anything is generated)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
