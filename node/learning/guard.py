"""The divergence guard: a node never trains on, nor publishes, a diverged model.

Two levels, one record:

- ``StepGuard`` lives in the learner and watches every local step: a non-finite loss or
  gradient norm, or a loss above ``factor`` × the running median of the recent step losses
  ("exploding" before it overflows), stops the local training, restores the parameters the
  call started from (the last state known finite), drops the optimizer state (a momentum or
  Adam buffer that saw the blow-up would carry it on) and halves the step size. The step size
  recovers (×2) after ``recover_after`` clean calls, so one bad batch does not slow a node for
  good.
- ``RoundGuard`` wraps a whole round for the node (``node/daemon.py`` calls it): it keeps the
  live parameters of the round's start; after the strategy's round (local steps *and* its merge
  of peers' models, pushed gradients, ...) it checks the live model and everything the strategy
  would publish (the round-start copy lives until the round's model is published, not between
  rounds). Anything non-finite: the round-start model is restored, the strategy is told
  (``on_diverged``: drop what it derived from the bad model) and the step size backs off.
  ``publishable`` is the last line: a non-finite group is never handed to peers.

Every event counts ``coterie_training_divergences_total{where}`` and is noted as a problem of
"this node (training)" in ``/status``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

Tensors = Mapping[str, torch.Tensor]


# elements checked at once: ``torch.isfinite`` of a whole tensor makes model-sized temporaries
# (|t| and two bool masks: 1.7 models for a float32 weight, measured), a chunk's stay ~4 MB
FINITE_CHUNK = 1 << 20


def is_finite(t: torch.Tensor) -> bool:
    """True when every element of ``t`` is finite; checked in chunks (bounded temporaries)."""
    if not t.is_floating_point():
        return True
    flat = t.detach().reshape(-1)  # a view of a contiguous tensor (a parameter, a snapshot's group)
    if flat.numel() <= FINITE_CHUNK:
        return bool(torch.isfinite(flat).all())
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(FINITE_CHUNK))


def all_finite(tensors: Tensors) -> bool:
    """True when every element of every tensor is finite."""
    return all(is_finite(t) for t in tensors.values())


class StepGuard:
    """Per-learner record of the step losses, the step-size scale and the divergences seen."""

    def __init__(
        self,
        factor: float = 1e3,
        window: int = 50,
        warmup: int = 5,
        recover_after: int = 10,
        min_scale: float = 2.0**-12,
        floor: float = 1e-2,
    ):
        self.factor, self.warmup, self.floor = float(factor), int(warmup), float(floor)
        self.recover_after, self.min_scale = int(recover_after), float(min_scale)
        self._losses: deque[float] = deque(maxlen=int(window))
        self.lr_scale = 1.0
        self.total = 0
        self._clean = 0
        self._pending: list[tuple[str, str]] = []

    def loss_problem(self, loss: float) -> str | None:
        """Why ``loss`` (a step's, on the model before the step) means divergence; None if fine."""
        if not math.isfinite(loss):
            return f"training loss is {loss}"
        if self.factor > 0 and len(self._losses) >= self.warmup:
            med = statistics.median(self._losses)
            limit = self.factor * max(med, self.floor)
            if loss > limit:
                return f"training loss {loss:.3g} exploded (> {self.factor:g} × running median {med:.3g})"
        return None

    def observe(self, loss: float) -> None:
        self._losses.append(float(loss))

    def diverged(self, where: str, reason: str) -> None:
        """Record a divergence and back off: the step size halves (down to ``min_scale``)."""
        self.total += 1
        self._clean = 0
        self.lr_scale = max(self.min_scale, self.lr_scale / 2)
        self._pending.append((where, f"{reason}; restored the last finite model, step size × {self.lr_scale:g}"))

    def clean(self) -> None:
        """A call with no divergence: after ``recover_after`` in a row the step size doubles back."""
        self._clean += 1
        if self.lr_scale < 1.0 and self._clean >= self.recover_after:
            self.lr_scale = min(1.0, self.lr_scale * 2)
            self._clean = 0

    def drain(self) -> list[tuple[str, str]]:
        out, self._pending = self._pending, []
        return out


class RoundStart(dict):
    """The round-start copy of the parameters (a ``dict`` the learner may reference weakly)."""


class RoundGuard:
    """The node's hook around one round. ``learner`` is the node's ``Learner`` (its
    ``step_guard``, when it has one, shares the step-size back-off and the event record);
    ``on_event(where, message)`` counts and reports (the node's metric and problem log)."""

    def __init__(self, learner: Any, strategy: Any, on_event: Callable[[str, str], None]):
        self.learner, self.strategy, self.on_event = learner, strategy, on_event
        self.steps: StepGuard = getattr(learner, "step_guard", None) or StepGuard()
        self._start: RoundStart | None = None
        # the published model's tensors (a getter) and the learner's change count they were read at
        self._published: tuple[Callable[[], Mapping[str, torch.Tensor] | None], int] | None = None

    def published(self, params: Callable[[], Mapping[str, torch.Tensor] | None] | None, changes: int | None) -> None:
        """The node published the live model as read when the learner's change count was
        ``changes`` (``params()``: the snapshot's tensors, immutable: peers read them). While the
        model stays as it was, the next round starts from those instead of a copy (issue 34: a
        model size less through the whole round). None: what was published is not the live model."""
        self._published = None if params is None or changes is None else (params, changes)

    def before_round(self) -> None:
        """Keep the round-start model (finite: it passed the previous round's check), and offer
        it to the learner as the rollback of its local steps (one copy of the model, not two) —
        the published snapshot's own tensors when the model has not changed since it was
        published, else a copy."""
        changes = getattr(self.learner, "changes", None)  # read first: a change after it voids the offer
        held = self._published[0]() if self._published is not None and self._published[1] == changes else None
        params = RoundStart(held if held is not None else self.learner.get_params())
        if all_finite(params):
            self._start = params
            offer = getattr(self.learner, "offer_rollback", None)
            if offer is not None and changes is not None:
                offer(params, changes)

    def after_round(self) -> bool:
        """Check the live model and what the strategy would publish; roll back if any is
        non-finite. Reports the learner's step-level events too. True when the round is clean."""
        bad = []
        if not self._live_finite():
            bad.append("the model after the round's update")
        shared = self.strategy.shared_params()
        if shared is not None and not all_finite(shared):
            bad.append("the model it would share")
        for name, tensors in self.strategy.published_extras().items():
            if not all_finite(tensors):
                bad.append(f"its published {name!r}")
        if bad:
            self.steps.diverged("merge", f"non-finite values in {', '.join(bad)}")
            self._restore()
        events = self.steps.drain()
        for where, message in events:
            self.on_event(where, message)
        return not events

    def _live_finite(self) -> bool:
        """The live model, checked in place where the learner has a torch module (no model-sized copy)."""
        model = getattr(self.learner, "model", None)
        if isinstance(model, torch.nn.Module):
            with torch.no_grad():
                return all_finite(dict(model.named_parameters()))
        return all_finite(self.learner.get_params())

    def _restore(self) -> None:
        if self._start is not None:
            reset = getattr(self.learner, "reset_after_divergence", None)
            if reset is not None:
                reset(self._start)
            else:
                self.learner.set_params(self._start)
        hook = getattr(self.strategy, "on_diverged", None)
        if hook is not None:
            hook()

    def publishable(self, groups: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """What may leave the node: a non-finite ``params`` group is replaced by the live (restored)
        model, other non-finite groups are left out."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensors in groups.items():
            if all_finite(tensors):
                out[name] = tensors
            elif name == "params":
                live = self.learner.get_params()
                out[name] = live if all_finite(live) else (self._start or live)
        self._start = None  # the round is over: its start is not kept between rounds (a model-sized copy)
        return out

    def round_published(self) -> None:
        """The round's model was published during the round (``publishing.publish_now``), each
        group checked then: the round is over, and its start is not kept (a model-sized copy)."""
        self._start = None
