"""Coterie extension example: a model, a dataset loader and a strategy, each registered by an
entry point in pyproject.toml. Nothing here is imported by Coterie until a node names it."""
