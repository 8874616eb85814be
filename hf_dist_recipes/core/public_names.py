"""The public names of a package, imported on first use: importing the package costs nothing, and a notebook or a
script reads a name from the package (`from hf_dist_recipes.planning import estimate`) rather than from the module
that holds it, which may move."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module


def lazy_names(package: str, public: dict[str, str]) -> Callable[[str], object]:
    """The module `__getattr__` of `package` for `public`: {name: "module"} or {name: "module:attribute"} (a name
    that differs from the attribute's, where the attribute's is also a submodule of the package, which an import
    binds on the package over a lazy name). AttributeError, as Python's own, for any other name."""

    def __getattr__(name: str):
        if name in public:
            module, _, attribute = public[name].partition(":")
            return getattr(import_module(module), attribute or name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
