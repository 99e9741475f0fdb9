"""What a node daemon imports, imported once in the launcher's fork server (``processes.py``).

The processes backend forks every daemon from one process that has already imported torch and
the node's code, instead of starting a fresh interpreter per node: a daemon starts in a fraction
of a second instead of paying torch's import (seconds of CPU each), and the imported code and data
(~150 MB of torch's and the node's module state) stay shared copy-on-write between all daemons
instead of being private to each. ``gc.freeze()`` keeps the collector from writing to those
objects (and so copying their pages) in the children.

Fork safety: everything here only imports: no gRPC
channel or server, no event loop, no thread pool is created before the fork — the daemon makes
its own after it. cryptography (the node certificates) comes in with the gRPC transport's TLS;
opacus' accountant (which pulls torch.distributed, ~1 s of CPU) is imported here once instead of
in every daemon's privacy warm-up."""

from __future__ import annotations

import gc

import numpy  # noqa: F401
import torch  # noqa: F401

import coterie.cli.main  # noqa: F401  (the daemons run its `node start`)
import coterie.cli.render  # noqa: F401
import coterie.node.admin  # noqa: F401  (aiohttp, httpx)
import coterie.node.daemon  # noqa: F401
import coterie.node.learning.torch_learner  # noqa: F401
import coterie.node.logs  # noqa: F401
import coterie.node.transport.grpc_transport  # noqa: F401  (grpc, cryptography via tls.py)
from coterie.node.privacy import accountant
from coterie.node.strategies.registry import builtin, get_strategy

accountant.warm()  # opacus' RDP analysis, imported and ready

# every built-in strategy module: a child imports only what it runs, but shares it all. Not the
# installed plugins: one that fails to import would take the fork server down with it (the child
# that runs a plugin imports it, and reports its error, itself)
for _name in builtin():
    get_strategy(_name)

gc.freeze()
