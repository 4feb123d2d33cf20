"""Optional dependencies: which extra of ``ddp-split-backend`` brings each one, and the one
line a user sees when one is missing (never a bare ``ModuleNotFoundError`` traceback).

Only pictures need one inside the package (matplotlib, extra ``plot``); the launcher
examples need the libraries of extra ``launchers``. The other extras serve this
repository's tests and benchmarks (README, "Use it in your script")."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "missing", "require"]

EXTRAS = {"matplotlib": "plot", "accelerate": "launchers", "lightning": "launchers", "transformers": "launchers"}
"""Module -> the extra that installs it."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message is one line naming the extra."""


def _message(module: str, purpose: str) -> str:
    return (f"ddp_split: {purpose} needs {module}, which is not installed here; "
            f"install it with: pip install 'ddp-split-backend[{EXTRAS[module]}]'")


def missing(module: str, purpose: str) -> str | None:
    """The one-line message if ``module`` cannot be imported, else ``None`` (nothing imported)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: imports of it are blocked
        found = False
    return None if found else _message(module, purpose)


def require(module: str, purpose: str) -> ModuleType:
    """``module``, imported; :class:`MissingExtra` (one line, naming the extra) if it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] != module:
            raise
        raise MissingExtra(_message(module, purpose), name=module) from None
