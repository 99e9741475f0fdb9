"""Strategy lookup by name: the built-in strategies plus any installed package's.

A package adds a strategy without forking Coterie by declaring an entry point in the group
``coterie.strategies`` (docs/extending.md)::

    [project.entry-points."coterie.strategies"]
    simavg = "coterie_example.strategy:SimilarityAveraging"   # a Strategy subclass, or a factory

A factory is called as the class would be, ``factory(node_id, learner, network, params, seed=...)``,
and must return a ``Strategy``. Built-in names take precedence over an entry point of the same
name; ``register_strategy`` adds one in-process (tests, notebooks).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

from .base import Strategy

GROUP = "coterie.strategies"

_MODULES = {
    "local": "baselines",
    "dpsgd": "baselines",
    "oracle": "baselines",
    "fedfomo": "fedfomo",
    "federico": "federico",
    "cobo": "cobo",
    "l2c": "l2c",
    "meta-l2c": "l2c",
    "scool-sbm": "scool",
    "scool-attention": "scool",
}

StrategyFactory = Callable[..., Strategy]  # (node_id, learner, network, params, seed=...) -> Strategy
_REGISTERED: dict[str, StrategyFactory] = {}


class StrategyError(ValueError):
    """A strategy name that does not resolve to a runnable Strategy, with the reason."""


def builtin() -> list[str]:
    return sorted(_MODULES)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def installed() -> dict[str, str]:
    """Strategies from entry points, name -> ``module:attr`` (built-in names shadow them)."""
    return {n: ep.value for n, ep in sorted(_entry_points().items()) if n not in _MODULES}


def available() -> list[str]:
    return sorted(set(_MODULES) | set(_REGISTERED) | set(_entry_points()))


def register_strategy(name: str, factory: StrategyFactory) -> None:
    """Register a Strategy subclass or factory in this process (entry points need no call)."""
    if name in _MODULES:
        raise StrategyError(f"strategy {name!r} is built in; pick another name")
    _REGISTERED[name] = factory


def _unknown(name: str) -> StrategyError:
    extra = sorted(set(_REGISTERED) | set(installed()))
    return StrategyError(
        f"unknown strategy {name!r}; built in: {', '.join(builtin())}; installed "
        f"({GROUP} entry points): {', '.join(extra) if extra else 'none'}"
    )


def _builtin(name: str) -> type[Strategy]:
    mod = importlib.import_module(f"{__package__}.{_MODULES[name]}")
    for obj in vars(mod).values():
        if isinstance(obj, type) and issubclass(obj, Strategy) and getattr(obj, "name", None) == name:
            return obj
    raise StrategyError(f"strategy {name!r} is not implemented yet")


def _checked(name: str, obj: Any, where: str) -> StrategyFactory:
    """A Strategy subclass as it is; a plain callable wrapped so its result is checked."""
    if isinstance(obj, type):
        if not issubclass(obj, Strategy):
            raise StrategyError(
                f"strategy {name!r} ({where}) is the class {obj.__module__}."
                f"{obj.__qualname__}, which is not a coterie Strategy subclass"
            )
        if obj.__abstractmethods__:
            raise StrategyError(
                f"strategy {name!r} ({where}) does not implement {', '.join(sorted(obj.__abstractmethods__))}"
            )
        return obj
    if not callable(obj):
        raise StrategyError(
            f"strategy {name!r} ({where}) is a {type(obj).__name__}, neither a Strategy subclass nor a factory"
        )

    def factory(*args: Any, **kwargs: Any) -> Strategy:
        s = obj(*args, **kwargs)
        if not isinstance(s, Strategy):
            raise StrategyError(
                f"strategy factory {name!r} ({where}) returned {type(s).__name__}, not a coterie Strategy"
            )
        return s

    factory.__name__ = getattr(obj, "__name__", name)
    return factory


def get_strategy(name: str) -> StrategyFactory:
    """What builds strategy ``name``: call it as ``(node_id, learner, network, params, seed=...)``.
    StrategyError (a ValueError) for an unknown name (listing what is available) or an entry
    point that fails to import or is not a Strategy."""
    if name in _MODULES:
        return _builtin(name)
    if name in _REGISTERED:
        return _checked(name, _REGISTERED[name], "registered in-process")
    ep = _entry_points().get(name)
    if ep is None:
        raise _unknown(name)
    dist = getattr(ep, "dist", None)  # (older importlib.metadata: no dist)
    where = f"entry point {ep.value!r}" + (f" of {dist.name}" if dist else "")
    try:
        obj = ep.load()
    except Exception as e:  # ImportError, AttributeError, or whatever the plugin module raises
        raise StrategyError(f"strategy {name!r}: {where} failed to load: {type(e).__name__}: {e}") from e
    return _checked(name, obj, where)


def strategy_problem(name: str) -> str | None:
    """None if ``name`` is importable, else why not (``coterie node start``'s preflight, ``coterie run``)."""
    try:
        get_strategy(name)
    except Exception as e:  # unknown, not implemented yet, or its module fails to import
        return f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
    return None
