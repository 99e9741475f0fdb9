"""A node's personalised model as a file others can use: export, load, ONNX.

An exported model is one safetensors file of the model's parameters (the names of
``model.named_parameters()``) whose metadata holds, under ``coterie_model``, the *model card*
(JSON): what the model is and where it comes from. ``FILE.json`` beside it holds the same card
plus ``file_sha256``, the file's own hash (a reader pairing the two can check them).

The card: ``format``, ``architecture`` (learner.model) and ``model_params``, ``input_shape``,
``num_classes``, ``task`` (classification | regression), ``class_names`` (None = regression),
``learner`` (the whole learner config: with it the model, and the node's data, can be rebuilt),
``node_id``, ``round``, ``version``, ``strategy``, ``weights`` (collaborator weights at that
round), ``eval`` (what the node reported for that round, e.g. test_acc), ``fingerprint``,
``exported_at`` (unix time) and ``checkpoint`` (the file it was read from).

The model is what the node predicts with at its last checkpoint: its own (``learner``
parameters), or, for a strategy that predicts with a mixture Σ_k w_k p(y|x; θ_k) of its own and
peers' models (FedeRiCo), every member: the node checkpoints the members its evaluation scored
(``Strategy.prediction_members``, ``Checkpoint.mixture``), the file names member k's parameters
``member{k}.<name>`` and the card lists ``mixture: [{node_id, weight}]``. ``load_model`` then
gives a ``MixtureModel`` whose output is log Σ_k w_k softmax(f_k(x)) (regression: Σ_k w_k f_k(x)),
so it reproduces the reported ``test_acc``/``test_loss``; ``own=True`` (``--own``) exports the own
model alone, which reproduces ``own_test_acc``. ONNX export of a mixture exports that module.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import save as st_save

from .fsutil import atomic_write_bytes, atomic_write_json, json_safe
from .persistence import Checkpoint, StateError, last_record, read_latest

FORMAT = "coterie-model/1"
META_KEY = "coterie_model"
_PARAMS = "learner/model/"  # the learner's parameters inside a checkpoint (torch_learner.export_state)


def describe_model(learner_cfg: Any, learner: Any) -> dict[str, Any]:
    """What a checkpoint records so its model can be rebuilt without the node's config (the
    daemon puts it in every checkpoint's state as ``model``)."""
    return {
        "architecture": learner_cfg.model,
        "model_params": dict(learner_cfg.model_params),
        "input_shape": [int(s) for s in getattr(learner, "input_shape", ())],
        "num_classes": int(getattr(learner, "num_classes", 0) or 0),
        "task": getattr(learner, "task", "classification"),
        "class_names": learner.class_names,
        "learner": learner_cfg.model_dump(mode="json"),
    }


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def export_checkpoint(ckpt: Checkpoint, directory: str | Path, own: bool = False) -> tuple[bytes, dict[str, Any]]:
    """(safetensors bytes, sidecar card) of a checkpoint's personalised model: the mixture the
    node predicted with if it checkpointed one (module doc), else (or with ``own``) its own model."""
    described = ckpt.state.get("model")
    if not isinstance(described, dict):
        raise StateError(
            f"{ckpt.path} was written by a coterie without model export (no model "
            "description in it): start the node with this version and let it "
            "checkpoint once"
        )
    params = {k[len(_PARAMS) :]: t.contiguous() for k, t in ckpt.tensors.items() if k.startswith(_PARAMS)}
    if not params:
        raise StateError(f"{ckpt.path} holds no model parameters ({_PARAMS}*)")
    members = None if own else ckpt.mixture()
    mixture = None
    if members and len(members) > 1:
        params = {f"member{k}.{n}": t.contiguous() for k, m in enumerate(members) for n, t in m["params"].items()}
        mixture = [{"node_id": m["node_id"], "weight": m["weight"]} for m in members]
    elif members:  # one model: the own one, or the local reference a backed-off node predicts with
        params = {n: t.contiguous() for n, t in members[0]["params"].items()}
    record = last_record(ckpt, directory) or {}
    card = json_safe(
        {
            "format": FORMAT,
            **described,
            "node_id": ckpt.node_id,
            "round": ckpt.round,
            "version": ckpt.version,
            "strategy": ckpt.state.get("strategy"),
            "weights": ckpt.state.get("weights") or {},
            "eval": record.get("eval") or {},
            "fingerprint": ckpt.state.get("fingerprint"),
            "exported_at": time.time(),
            "checkpoint": ckpt.path.name,
        }
    )  # JSON has no NaN: a NaN loss becomes null
    if mixture:
        card["mixture"] = mixture
    data = st_save(params, metadata={META_KEY: json.dumps(card, sort_keys=True)})
    return data, {**card, "file_sha256": _sha256(data)}


def export_state_dir(state_dir: str | Path, own: bool = False) -> tuple[bytes, dict[str, Any]]:
    """The personalised model of the newest checkpoint in ``state_dir`` (its node may be running);
    ``own``: the node's own model even where it predicts with a mixture."""
    return export_checkpoint(read_latest(state_dir), state_dir, own)


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def write_export(state_dir: str | Path, out: str | Path, fmt: str = "safetensors", own: bool = False) -> dict[str, Any]:
    """Write the model (``fmt``: safetensors or onnx) to ``out`` and its card to ``out``.json;
    return the card. ``own``: the node's own model, not the mixture it predicts with."""
    data, card = export_state_dir(state_dir, own)
    if fmt == "onnx":
        loaded = _load_bytes(data, str(out))
        data = onnx_bytes(loaded)
        output_is = (
            "value" if loaded.task != "classification" else "log_probabilities" if card.get("mixture") else "logits"
        )
        card = {
            **card,
            "file_format": "onnx",
            "onnx": {"input": "input", "output": "output", "output_is": output_is},
            "file_sha256": _sha256(data),
        }
    elif fmt == "safetensors":
        card = {**card, "file_format": "safetensors"}
    else:
        raise ValueError(f"unknown export format {fmt!r}: safetensors or onnx")
    atomic_write_bytes(out, data)
    atomic_write_json(sidecar_path(out), card)
    return card


# ------------------------------------------------------------------------------------ loading
@dataclass
class ExportedModel:
    """``load_model``'s answer: an eval-mode torch module, the class name of each output (None
    for regression) and the model card. Unpacks as ``model, class_names = coterie.load_model(f)``."""

    model: torch.nn.Module
    class_names: list[str] | None
    card: dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.class_names))

    @property
    def task(self) -> str:
        return self.card.get("task", "classification")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.card.get("input_shape") or ())


def _card_of(data: bytes, where: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load as st_load

    try:
        tensors = st_load(data)
        hlen = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + hlen]).get("__metadata__") or {}
        card = json.loads(meta[META_KEY])
    except (SafetensorError, ValueError, KeyError, TypeError, AttributeError) as e:
        what = f"no {e} metadata" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{where} is not a coterie model export ({what})") from None
    if not isinstance(card, dict) or card.get("format") != FORMAT:
        raise ValueError(
            f"{where}: model card format {card.get('format') if isinstance(card, dict) else card!r}, "
            f"expected {FORMAT!r}"
        )
    return card, tensors


class MixtureModel(torch.nn.Module):
    """Σ_k w_k p(y|x; θ_k) as one module, computed as the node's own mixture evaluation does
    (learning/torch_mixture.py). Classification: the log of the mixed softmax probabilities, so
    its argmax and softmax are the mixture's prediction and probabilities; regression: the
    weighted mean output. ``members[k]``: the k-th model (tensor names ``member{k}.*``)."""

    def __init__(self, members: list[torch.nn.Module], weights: list[float], task: str):
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        self.weights = [float(w) for w in weights]
        self.task = task

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix: torch.Tensor | None = None
        for w, m in zip(self.weights, self.members, strict=True):
            out = m(x)
            out = out.softmax(1) if self.task == "classification" else out
            mix = w * out if mix is None else mix + w * out
        assert mix is not None  # _load_bytes refuses an empty mixture
        return mix.log() if self.task == "classification" else mix


def _build(card: dict[str, Any], params: dict[str, torch.Tensor], where: str, what: str) -> torch.nn.Module:
    """The card's architecture with ``params`` (exactly its parameters) in it."""
    from .learning.models import build_model

    try:
        with torch.random.fork_rng(devices=[]):  # the weights are overwritten: leave the caller's RNG alone
            model = build_model(
                card["architecture"],
                card["input_shape"],
                card.get("num_classes", 0),
                **(card.get("model_params") or {}),
            )
    except KeyError as e:
        raise ValueError(f"{where}: the model card lacks {e}") from None
    own = dict(model.named_parameters())
    missing, extra = sorted(set(own) - set(params)), sorted(set(params) - set(own))
    if missing or extra:
        raise ValueError(
            f"{where}{what} does not fit architecture {card['architecture']!r}: missing {missing}, unexpected {extra}"
        )
    with torch.no_grad():
        for n, p in own.items():
            if tuple(params[n].shape) != tuple(p.shape):
                raise ValueError(
                    f"{where}{what}: parameter {n!r} has shape {tuple(params[n].shape)}, the "
                    f"architecture wants {tuple(p.shape)}"
                )
            p.copy_(params[n].to(p.dtype))
    return model


def _load_bytes(data: bytes, where: str) -> ExportedModel:
    card, params = _card_of(data, where)
    mixture = card.get("mixture")
    model: torch.nn.Module
    if mixture is None:
        model = _build(card, params, where, "")
    else:
        try:
            weights = [float(m["weight"]) for m in mixture]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"{where}: the model card's mixture is malformed ({type(e).__name__}: {e})") from None
        if not weights or not all(w > 0 and w == w for w in weights):  # w == w: not NaN
            raise ValueError(f"{where}: the mixture's weights must be positive, got {weights}")
        members = []
        for k in range(len(weights)):
            pre = f"member{k}."
            members.append(
                _build(
                    card,
                    {n[len(pre) :]: t for n, t in params.items() if n.startswith(pre)},
                    where,
                    f" (mixture member {k})",
                )
            )
        stray = sorted(n for n in params if not any(n.startswith(f"member{k}.") for k in range(len(weights))))
        if stray:
            raise ValueError(f"{where}: tensors {stray[:5]} belong to no mixture member")
        model = MixtureModel(members, weights, card.get("task", "classification"))
    model.eval()
    return ExportedModel(model, card.get("class_names"), card)


def load_model(path: str | Path) -> ExportedModel:
    """Load an exported model (``coterie model export``, ``GET /model``): an eval-mode
    ``torch.nn.Module`` on the CPU and its class names. A ``FILE.json`` beside it, if there, must
    describe this very file (its ``file_sha256``)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read model file {path}: {e.strerror or e}") from None
    side = sidecar_path(path)
    if side.exists():
        try:
            want = json.loads(side.read_text()).get("file_sha256")
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{side} is not a readable model card: {e}") from None
        if want is not None and want != _sha256(data):
            raise ValueError(
                f"{side} does not describe {path} (sha256 differs): the two files come from different exports"
            )
    return _load_bytes(data, str(path))


def onnx_bytes(loaded: ExportedModel) -> bytes:
    """The model as an ONNX graph (opset 17, batch dimension dynamic): input ``input``, output
    ``output`` (logits for classification). Uses torch's TorchScript-based exporter, which needs
    only the ``onnx`` package (the newer dynamo one also wants onnxscript)."""
    import io

    try:
        import onnx  # noqa: F401 - torch.onnx needs it; say so clearly
    except ImportError:
        raise ValueError("--format onnx needs the onnx package: pip install 'coterie[onnx]'") from None
    buf = io.BytesIO()
    example = torch.zeros(1, *loaded.input_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        # torch's annotation of ``f`` names paths only, but the TorchScript exporter (dynamo=False)
        # writes to a file object too, as its docs say: hence the cast
        torch.onnx.export(
            loaded.model,
            (example,),
            cast(Any, buf),
            dynamo=False,
            opset_version=17,
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        )
    return buf.getvalue()
