"""The local-only reference: evidence of what this node would have alone, and the back-off when
collaboration does worse than that (issue 33; docs/never-worse.md).

A *twin* of the model (``Learner.local_twin``: same samples, same θ⁰, same batch order, its own
optimizer) trains one round's local steps every round, alongside the strategy's exchange; a model
over ``reference.shadow_max_params`` trains its twin one round in ``large_every`` (cheaper, and a
weaker reference, so the node errs towards collaborating) and drops its optimizer state after
each of those trainings (Adam's two model-sized moments are not held between them; issue 34).
Once the twin's validation score has not improved for ``settle_after`` checks it stops training
(it has learnt what this node can learn alone) and costs only its cached scores from then on. Every ``check_every`` rounds the model
the node predicts with (the live model, or the strategy's mixture) and the twin are scored on the
*validation* split (never test) and ``CollaborationCheck`` decides. Backed off, the node predicts,
reports (``test_acc``) and exports the twin; it still collaborates and publishes its own model,
so it returns as soon as collaboration is better again. With ``reference.predict = "blend"``, while
the check collaborates the node predicts with neither model alone but with their blend
(``reference.blend_space``), α chosen on the validation split at every check (``node/blend.py``);
backed off, it predicts with the twin as before.
Strategy-agnostic: strategies never see it.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, cast

import torch

from .blend import alphas, blend, choose
from .collaboration_check import CollaborationCheck, Paired, Score, paired
from .config import ReferenceConfig
from .learning.learner import EvalResult, Learner, MakesTwin, Params, Split

log = logging.getLogger("coterie.node")

Members = list[tuple[str, float, Params]]
Scored = list[tuple[str, float, Params | None]]  # members to evaluate: None is the live model, read in place
NO_TWIN_STRATEGIES = ("local",)  # its model *is* the local-only model


def _score(r: EvalResult) -> Score:
    return Score(loss=float(r.loss), accuracy=r.accuracy, n=int(r.n))


def _paired(collab: EvalResult, local: EvalResult) -> Paired | None:
    """The two models' per-sample evidence on the same split, where the learner gives it."""
    if collab.losses is None or local.losses is None:
        return None
    return paired(collab.losses, local.losses, collab.correct, local.correct)


class LocalReference:
    def __init__(self, cfg: ReferenceConfig, learner: Learner, strategy: str):
        self.cfg, self.learner = cfg, learner
        self.check = CollaborationCheck(cfg.patience, cfg.z, cfg.mse_margin, cfg.rule, cfg.paired_on, cfg.pool)
        self.trained_round = 0  # last round the twin trained for (a retried round does not train it twice)
        self.twin: Learner | None = None
        self.settled_at: int | None = None  # the round the twin stopped training (see settle_after)
        self._best: float | None = None  # the twin's best validation score (higher is better)
        self._since_best = 0
        self._trained = 0  # twin trainings so far: its cached scores are for this count
        self._cached: dict[str, tuple[int, EvalResult]] = {}
        self.note: str | None = None  # why there is no reference, or what limits it
        self._lock = threading.Lock()  # the twin trains and is evaluated from worker threads
        self.grid = alphas(cfg.blend_steps)
        # predict = "blend": the weight on collaboration the last check chose (None before the
        # first: the node predicts with its collaborative model), and every α's validation loss
        self.alpha: float | None = None
        self.alpha_losses: list[float] = []
        self._accuracy_first = False  # the last α was chosen among the most accurate blends
        size = sum(math.prod(shape) for shape, _ in learner.param_spec().values())
        self.large = size > cfg.shadow_max_params
        self.every = cfg.large_every if self.large else 1
        if not cfg.enabled:
            self.note = "reference.enabled is false: no local-only reference, no back-off"
        elif strategy in NO_TWIN_STRATEGIES:
            self.note = f"strategy {strategy!r} learns alone: its model is the local reference"
        elif not isinstance(learner, MakesTwin):
            self.note = f"{type(learner).__name__} makes no local twin: no back-off"
        else:
            self.twin = learner.local_twin()
            if self.every > 1:
                self.note = (
                    f"model of {size} parameters > reference.shadow_max_params {cfg.shadow_max_params}: "
                    f"the local twin trains one round in {self.every}"
                )

    @property
    def active(self) -> bool:
        return self.twin is not None

    @property
    def trains_alone(self) -> bool:
        """A large model's twin trains on its own at the start of a round, before the round guard
        copies the model, not beside the strategy's round: its Adam moments, re-made for the round
        it trains, its gradient and its rollback copy (4 models) came on top of the round's own
        training and exchange, and every node of an 8-node D-PSGD network of a 21 MB MLP peaked in
        that round (bench/results/memory.md, branch dpsgdpeak)."""
        return self.large and self.twin is not None

    @property
    def blending(self) -> bool:
        return self.twin is not None and self.cfg.predict == "blend"

    @property
    def helping(self) -> bool:
        """Collaboration has a part in what the node predicts with: the check has not backed off
        and, blending, α > 0."""
        return self.check.helping and (not self.blending or self.alpha is None or self.alpha > 0)

    @property
    def backed_off(self) -> bool:
        return self.twin is not None and not self.helping

    def _collab(self, members: Members | None, node_id: str) -> Members:
        """What the node predicts with by collaborating: the strategy's mixture, or (a copy of) its
        live model."""
        return members if members else [(node_id, 1.0, self.learner.get_params())]

    def _collab_to_score(self, members: Members | None, node_id: str) -> Scored:
        """``_collab`` for an evaluation: in prediction space the live model as None, which the
        learner reads in place (weight space computes α·θ + (1−α)·θ_twin from its tensors)."""
        if members or self.cfg.blend_space != "prediction":
            return list(self._collab(members, node_id))
        return [(node_id, 1.0, None)]

    def _twin_to_score(self) -> Params:
        """The twin's parameters for an evaluation: its own tensors, not a copy (held under
        ``_lock``, which its training also takes, so they do not change meanwhile)."""
        assert self.twin is not None
        return self.twin.live_params()

    def _choose_alpha(self, collab: Scored) -> None:
        """The blend's α for this check: the lowest validation loss on the grid, of the most
        accurate blends where the task has an accuracy (node/blend.py)."""
        twin = self._twin_to_score()
        if self.cfg.blend_space == "prediction":  # every α from one pass of each model
            scored = self.learner.evaluate_blends([(w, p) for _, w, p in collab], twin, self.grid, "val")
        else:
            scored = []
            for alpha in self.grid:
                ms = blend(collab, twin, alpha, "twin", self.cfg.blend_space)
                scored.append(self.learner.evaluate_mixture([(w, p) for _, w, p in ms], "val"))
        loss = {a: r.loss for a, r in zip(self.grid, scored, strict=True)}
        acc = {a: r.accuracy for a, r in zip(self.grid, scored, strict=True) if r.accuracy is not None}
        self._accuracy_first = len(acc) == len(self.grid)  # classification: accuracy first
        self.alpha, self.alpha_losses = choose(
            self.grid, loss.__getitem__, acc.__getitem__ if self._accuracy_first else None
        )

    def train(self, rnd: int) -> None:
        """The twin's share of round ``rnd`` (run in a worker thread, while the strategy's round runs)."""
        if self.twin is None or rnd <= self.trained_round:
            return
        with self._lock:
            if self.settled_at is None and (rnd % self.every == 0 or self.every == 1):
                self.twin.train()
                self._trained += 1
                if self.every > 1:  # a large model: its twin's Adam moments are not kept between its trainings
                    drop = getattr(self.twin, "drop_optimizer_state", None)
                    if drop is not None:
                        drop()
            self.trained_round = rnd

    def _twin_eval(self, split: Split) -> EvalResult:
        """The twin's score on ``split``, evaluated again only after it trained."""
        assert self.twin is not None
        hit = self._cached.get(split)
        if hit is None or hit[0] != self._trained:
            hit = (self._trained, self.twin.evaluate(split))
            self._cached[split] = hit
        return hit[1]

    def _settle(self, rnd: int, local_val: Score) -> None:
        """Stop training the twin once its validation score stopped improving."""
        value = local_val.accuracy if local_val.accuracy is not None else -local_val.loss
        if self._best is None or value > self._best:
            self._best, self._since_best = value, 0
            return
        self._since_best += 1
        if self.cfg.settle_after and self._since_best >= self.cfg.settle_after and self.settled_at is None:
            self.settled_at = rnd

    def judge(self, rnd: int, evaluation: dict[str, float], members: Members | None) -> dict[str, float]:
        """Round ``rnd``'s evaluation as the node reports it: the twin's test figures beside the
        collaborative ones, a check on the validation split every ``check_every`` rounds, and,
        backed off, the twin's figures as ``test_acc``/``test_loss`` (the collaborative ones kept
        as ``collab_test_*``). ``members``: the strategy's prediction mixture, None for its model."""
        if self.twin is None:
            return evaluation
        with self._lock:
            local_test = self._twin_eval("test")
            if rnd % self.cfg.check_every == 0:
                collab_val = (
                    self.learner.evaluate_mixture([(w, p) for _, w, p in members], "val")
                    if members and len(members) > 1
                    else self.learner.evaluate("val")
                )
                twin_val = self._twin_eval("val")
                local_val = _score(twin_val)
                was = self.check.helping
                evidence = _paired(collab_val, twin_val)
                if collab_val.n:
                    self.check.observe(_score(collab_val), local_val, evidence)
                    if self.blending and self.check.helping:
                        self._choose_alpha(self._collab_to_score(members, "self"))
                    elif self.blending:  # backed off: the twin alone, until the check returns
                        self.alpha, self.alpha_losses = 0.0, []
                    if self.check.helping != was:  # the check's switches (α moves every check: /status)
                        log.warning("%s", self.reason())
                self._settle(rnd, local_val)
            # the blend's test figures (0 < α < 1); α = 0 is the twin, α = 1 the collaborative model
            blended = None
            if self.blending and self.alpha is not None and 0 < self.alpha < 1:
                ms = blend(
                    self._collab_to_score(members, "self"),
                    self._twin_to_score(),
                    self.alpha,
                    "twin",
                    self.cfg.blend_space,
                )
                blended = self.learner.evaluate_mixture([(w, p) for _, w, p in ms], "test")
        out = dict(evaluation)
        out["local_test_loss"] = local_test.loss
        if local_test.accuracy is not None:
            out["local_test_acc"] = local_test.accuracy
        out["helping"] = 1.0 if self.helping else 0.0
        if self.blending and self.alpha is not None:
            out["blend_alpha"] = self.alpha
        if self.helping and blended is None:
            return out
        for k in ("test_acc", "test_loss"):
            if k in evaluation:
                out[f"collab_{k}"] = evaluation[k]
        shown = blended if blended is not None else local_test
        out["test_loss"] = shown.loss
        if shown.accuracy is not None:
            out["test_acc"] = shown.accuracy
        return out

    def prediction_members(self, node_id: str, collab: Members | None = None, live: bool = False) -> Members | None:
        """What the node predicts with when that is not its collaborative model (``collab``: the
        strategy's prediction members, None for its live model): backed off, the twin; blending
        with 0 < α < 1, the blend. Checkpointed, so an export writes it; None otherwise.
        ``live``: the model's and twin's own tensors, not copies, for a live checkpoint (written
        before either changes; ``make_snapshot`` names them, the file holds them once)."""
        if (
            self.twin is None
            or not self.backed_off
            and not (self.blending and self.alpha is not None and self.alpha < 1)
        ):
            return None
        with self._lock:
            twin = self.twin.live_params() if live else self.twin.get_params()
            if self.backed_off:
                return [(node_id, 1.0, twin)]
            assert self.alpha is not None
            own = collab or [(node_id, 1.0, self.learner.live_params() if live else self.learner.get_params())]
            # (members given: the result holds their tensors, none None)
            return cast(Members, blend(own, twin, self.alpha, node_id, self.cfg.blend_space))

    def reason(self) -> str | None:
        """Why the node predicts with what it predicts with (the check's figures as evidence)."""
        if not self.blending or self.alpha is None or self.check.last is None or not self.check.helping:
            return self.check.reason()
        of = f"the lowest validation loss of {len(self.grid)} blends"
        if self._accuracy_first:
            of = f"the lowest validation loss of the most accurate of {len(self.grid)} blends"
        if self.alpha == 0:
            return (
                f"collaboration is not helping this node: {self.check.figures()}; "
                f"predicting with the local model (α = 0: {of})"
            )
        if self.alpha == 1:
            return f"{self.check.reason()}; predicting with the collaborative model (α = 1: {of})"
        what = "weights" if self.cfg.blend_space == "weight" else "predictions"
        return (
            f"predicting with a blend of the collaborative and the local model's {what}, α = {self.alpha:.2g} on "
            f"collaboration ({of}): {self.check.figures()}"
        )

    def view(self) -> dict[str, Any]:
        """/status's ``collaboration``: helping, why, and the reference's own figures."""
        return {
            "helping": self.helping,
            "reason": self.reason() if self.active else self.note,
            "predicting_with": self._predicting_with(),
            "reference": {
                "active": self.active,
                "note": self.note,
                "trains_every_rounds": self.every if self.active else None,
                "settled_at_round": self.settled_at,
                **self.check.to_json(),
            },
        }

    def _predicting_with(self) -> dict[str, Any]:
        """/status: the model the node predicts with, reports and exports, and the blend's α."""
        if not self.active:
            return {"model": "collaborative"}
        if not self.blending:
            return {"model": "local" if self.backed_off else "collaborative", "rule": "choose"}
        alpha = 1.0 if self.alpha is None else self.alpha
        model = "local" if alpha == 0 else "collaborative" if alpha == 1 else "blend"
        return {
            "model": model,
            "rule": "blend",
            "alpha": alpha,
            "space": self.cfg.blend_space,
            "val_loss_by_alpha": dict(zip((f"{a:.2g}" for a in self.grid), self.alpha_losses, strict=False)),
        }

    # ------------------------------------------------------------------ persistence
    def export_state(self, live: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The twin's state and the decision's; ``live``: the twin's own tensors (see
        ``Learner.export_state``), for a write that ends before the twin trains again."""
        if self.twin is None:
            return None
        with self._lock:
            tensors, meta = self.twin.export_state(live=True) if live else self.twin.export_state()
        settle = {"settled_at": self.settled_at, "best": self._best, "since_best": self._since_best}
        chosen = {"alpha": self.alpha, "val_losses": self.alpha_losses}
        return tensors, {
            "twin": meta,
            "trained_round": self.trained_round,
            "check": self.check.to_json(),
            "blend": chosen,
            **settle,
        }

    def import_state(self, state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None, rnd: int) -> None:
        """Resume the twin and the decision; a checkpoint without them (or one that does not fit
        this twin) restarts the reference from θ⁰ at round ``rnd``, said in its note and the log
        (the reference is evidence, not the node's model: the node starts anyway)."""
        if self.twin is None:
            return
        problem = "the checkpoint holds no local reference"
        if state is not None:
            tensors, meta = state
            try:
                self.twin.import_state(tensors, meta["twin"])
                self.check.load_json(meta["check"])
                self.trained_round = int(meta["trained_round"])
                settled, best = meta.get("settled_at"), meta.get("best")
                self.settled_at = None if settled is None else int(settled)
                self._best = None if best is None else float(best)
                self._since_best = int(meta.get("since_best", 0))
                chosen = meta.get("blend") or {}  # a checkpoint from before the blend: the next check chooses
                self.alpha = None if chosen.get("alpha") is None else float(chosen["alpha"])
                self.alpha_losses = [float(x) for x in chosen.get("val_losses") or []]
                self._trained += 1  # scores cached before the import are stale
                return
            except (KeyError, TypeError, ValueError) as e:
                problem = f"its local reference does not fit ({type(e).__name__}: {e})"
        self.trained_round = rnd
        self.note = f"the local reference restarted from the initial model at round {rnd}: {problem}"
        log.warning("%s", self.note)
