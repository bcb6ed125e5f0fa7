"""`--help` without the parts of rich it never draws: typer's help renderer imports
rich.markdown (markdown-it) and rich.traceback (pygments) up front, 0.15 s of a 0.45 s
`mlxlocal --help`, for markdown help and pretty tracebacks, neither of which we use. Until
something really uses them, those two modules are stand-ins whose `Markdown` and `Traceback`
import the real module when first called (or isinstance-checked); any other name imports it
at once."""

from __future__ import annotations

import importlib
import sys
import types

_DEFERRED = {"rich.markdown": "Markdown", "rich.traceback": "Traceback"}


class _Deferred(types.ModuleType):
    def __init__(self, name: str, attr: str):
        super().__init__(name)
        self.__dict__["_attr"] = attr

    def _real(self) -> types.ModuleType:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        real = importlib.import_module(self.__name__)  # now the real one in sys.modules
        return real

    def __getattr__(self, name: str):
        if name == self.__dict__["_attr"]:
            return _stand_in(self, name)
        if name.startswith("__"):  # the import system's probes (__path__, __spec__ ...)
            raise AttributeError(name)
        return getattr(self._real(), name)


def _stand_in(module: _Deferred, name: str) -> type:
    def real_class() -> type:
        return getattr(module._real(), name)

    class Meta(type):
        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, real_class())

        def __call__(cls, *args, **kwargs):
            return real_class()(*args, **kwargs)

    return Meta(name, (), {"__module__": module.__name__, "__doc__": f"{module.__name__}.{name}, imported "
                                                                         "when first used"})


def install() -> None:
    """Put the stand-ins in place unless the real modules are already loaded (the package
    attribute too: `import rich.markdown; rich.markdown.Markdown` finds it)."""
    import rich

    for mod, attr in _DEFERRED.items():
        if mod not in sys.modules:
            sys.modules[mod] = stand_in = _Deferred(mod, attr)
            setattr(rich, mod.split(".")[1], stand_in)


install()
