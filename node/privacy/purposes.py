"""Why a peer may compute on this node's private data: the one table of purposes.

Every served request (and every gradient this node sends out on its own data) names a purpose.
The purpose fixes the split it is computed on and the kind of answer; a node answers only the
purposes of its own strategy (or ``privacy.serve_purposes``), never on the test split, never on
fewer than ``privacy.min_batch`` samples. Strategies not listed here (local, D-PSGD, oracle,
FedFomo, L2C, meta-L2C) ask for no compute on peers' data: they evaluate peers' published models
on their *own* data (FedFomo, L2C: their own validation split), which sends nothing out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config reads this table; it need not import torch for a type
    from ..learning.learner import Split

# what comes back: a loss, a gradient, only <gradient, a vector the caller sent>, or (push) a
# gradient this node computed on its own data and sends to the peer whose model it is
LOSS, GRADIENT, ALIGNMENT, PUSH = "loss", "gradient", "alignment", "push"
SERVED_SPLITS = ("train", "val")  # never "test": it measures the node, it does not teach peers


@dataclass(frozen=True)
class Purpose:
    name: str
    kind: str
    split: Split
    strategies: tuple[str, ...]
    why: str  # the paper step it serves, and why that split


PURPOSES: dict[str, Purpose] = {
    p.name: p
    for p in (
        Purpose(
            "scool-evidence",
            LOSS,
            "train",
            ("scool-sbm", "scool-attention"),
            "SCool's evidence Y_ij = log P(D_j | θ_i) (eq. 18/29): the likelihood of j's local "
            "training data; the authors' code uses one training minibatch",
        ),
        Purpose(
            "scool-gradient",
            GRADIENT,
            "train",
            ("scool-sbm", "scool-attention"),
            "SCool's exact M-step (eq. 22): ∇L(D_j; θ_i), the gradient of j's training loss",
        ),
        Purpose(
            "cobo-alignment",
            ALIGNMENT,
            "train",
            ("cobo",),
            "COBO's client selection (eq. 1/4): ⟨∇f_i(z), ∇f_j(z)⟩, f_j the training objective; "
            "both ends' gradients are released (the caller's is the vector it sends)",
        ),
        Purpose(
            "federico-push",
            PUSH,
            "train",
            ("federico",),
            "FedeRiCo's M-step (eq. 8, Alg. 1 l.19): node i pushes w_ib ∇ℓ(θ_b; D_i), the "
            "gradient of b's model on i's training data",
        ),
    )
}

for _p in PURPOSES.values():  # the table itself must never expose the test split
    assert _p.split in SERVED_SPLITS, _p


def purpose(name: str) -> Purpose:
    """The purpose called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PURPOSES[name]
    except KeyError:
        raise ValueError(f"unknown purpose {name!r}; known: {sorted(PURPOSES)}") from None


def purposes_of(strategy: str) -> tuple[str, ...]:
    """The purposes a node running ``strategy`` answers (and uses)."""
    return tuple(sorted(n for n, p in PURPOSES.items() if strategy in p.strategies))
