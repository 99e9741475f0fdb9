"""Strategy lookup by name; each strategy module registers itself here on import."""
from __future__ import annotations

import importlib

from .base import Strategy

_MODULES = {
    "local": "baselines", "dpsgd": "baselines", "oracle": "baselines",
    "fedfomo": "fedfomo", "federico": "federico", "cobo": "cobo",
    "l2c": "l2c", "meta-l2c": "l2c", "scool-sbm": "scool", "scool-attention": "scool",
}


def available() -> list[str]:
    return sorted(_MODULES)


def get_strategy(name: str) -> type[Strategy]:
    if name not in _MODULES:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(available())}")
    mod = importlib.import_module(f"{__package__}.{_MODULES[name]}")
    for obj in vars(mod).values():
        if isinstance(obj, type) and issubclass(obj, Strategy) and getattr(obj, "name", None) == name:
            return obj
    raise ValueError(f"strategy {name!r} is not implemented yet")


def strategy_problem(name: str) -> str | None:
    """None if ``name`` is importable, else why not (``coterie node start``'s preflight, ``coterie run``)."""
    try:
        get_strategy(name)
    except Exception as e:  # unknown, not implemented yet, or its module fails to import
        return f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
    return None
