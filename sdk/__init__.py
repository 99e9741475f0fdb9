"""Coterie: peer-to-peer decentralized personalised learning — the ``coterie`` package itself.

This folder is only the package's ``__init__``: the code lives in the repository's folders that
pyproject.toml maps below it (node/ → coterie.node, cli/ → coterie.cli, proto/ → coterie.proto).
What ``import coterie`` offers applications:

    model, class_names = coterie.load_model("model.safetensors")   # an ExportedModel (also .card)

Attributes load lazily (PEP 562): every ``import coterie.<sub>`` runs this file first, and the
CLI must not pay for torch before a command needs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_model", "ExportedModel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from .node import modelfile

        return getattr(modelfile, name)
    raise AttributeError(f"module 'coterie' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
