"""Stock models and the model registry.

``build_model(name, input_shape, num_classes, **model_params)``; ``num_classes == 0`` means
regression (one output). No BatchNorm anywhere: mixing BN statistics between peers is
ill-defined (GroupNorm via ``norm="group"`` or nothing).

Stock models and their ``model_params``:

- ``linear``: flatten → Linear.
- ``mlp``: ``hidden`` (list of widths, default [64, 64]) with ReLU.
- ``cnn``: the 2-conv CNN of McMahan et al. (FedAvg): conv k×k ``channels[0]`` → ReLU → 2×2
  max-pool → conv ``channels[1]`` → ReLU → max-pool → FC ``fc`` → ReLU → FC. ``channels``
  ([32, 64]), ``kernel`` (5), ``fc`` (512), ``norm`` ("none" | "group"), ``groups`` (8).
- ``cnn2``: FedeRiCo's CNN2 (Shen et al.): three 3×3 convs of ``channels`` (128) each followed
  by 2×2 max-pool and ReLU, then one FC. ``channels``, ``kernel`` (3), ``norm``, ``groups``.

Convs use "same" padding, and pools are skipped once the map is down to 1, so small inputs
(8×8 digits) still work. 1-D inputs (``input_shape`` ``(L,)`` or ``(C, L)``, e.g. MNIST-1D)
use Conv1d; ``(C, H, W)`` uses Conv2d.

Third-party models: an entry point in group ``coterie.models`` (``name =
"pkg.module:factory"``, ``factory(input_shape, num_classes, **model_params) -> nn.Module``), or
``register_model(name, factory)`` in-process. Stock names take precedence.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from torch import nn

Factory = Callable[..., nn.Module]
_REGISTERED: dict[str, Factory] = {}


def _out(num_classes: int) -> int:
    return num_classes if num_classes > 0 else 1


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def linear(input_shape, num_classes, **kw) -> nn.Module:
    if kw:
        raise ValueError(f"linear takes no model_params, got {sorted(kw)}")
    return nn.Sequential(nn.Flatten(), nn.Linear(_numel(input_shape), _out(num_classes)))


def mlp(input_shape, num_classes, hidden=(64, 64)) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = _numel(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        width = int(h)
    layers.append(nn.Linear(width, _out(num_classes)))
    return nn.Sequential(*layers)


class _Unsqueeze(nn.Module):
    def forward(self, x):
        return x.unsqueeze(1)


def _conv_stack(
    input_shape, convs: list[int], kernel: int, norm: str, groups: int, pool_then_act: bool
) -> tuple[list[nn.Module], int]:
    if norm not in ("none", "group"):
        raise ValueError(f"norm must be 'none' or 'group' (never BatchNorm), got {norm!r}")
    shape = tuple(int(s) for s in input_shape)
    layers: list[nn.Module] = []
    if len(shape) == 1:
        layers.append(_Unsqueeze())
        shape = (1,) + shape
    Conv: type[nn.Module]
    Pool: type[nn.Module]
    if len(shape) == 2:
        Conv, Pool = nn.Conv1d, nn.MaxPool1d
    elif len(shape) == 3:
        Conv, Pool = nn.Conv2d, nn.MaxPool2d
    else:
        raise ValueError(f"CNNs take inputs shaped (L,), (C, L) or (C, H, W), got {input_shape}")
    ch, spatial = shape[0], list(shape[1:])
    for out_ch in convs:
        layers.append(Conv(ch, int(out_ch), kernel, padding=kernel // 2))
        ch = int(out_ch)
        if norm == "group":
            g = max(d for d in range(1, min(groups, ch) + 1) if ch % d == 0)
            layers.append(nn.GroupNorm(g, ch))
        block: list[nn.Module] = [nn.ReLU()]
        if min(spatial) >= 2:
            block = [Pool(2), nn.ReLU()] if pool_then_act else [nn.ReLU(), Pool(2)]
            spatial = [s // 2 for s in spatial]
        layers += block
    layers.append(nn.Flatten())
    return layers, ch * _numel(spatial)


def cnn(input_shape, num_classes, channels=(32, 64), kernel=5, fc=512, norm="none", groups=8) -> nn.Module:
    layers, flat = _conv_stack(input_shape, list(channels), int(kernel), norm, int(groups), False)
    layers += [nn.Linear(flat, int(fc)), nn.ReLU(), nn.Linear(int(fc), _out(num_classes))]
    return nn.Sequential(*layers)


def cnn2(input_shape, num_classes, channels=128, kernel=3, norm="none", groups=8) -> nn.Module:
    layers, flat = _conv_stack(input_shape, [int(channels)] * 3, int(kernel), norm, int(groups), True)
    layers.append(nn.Linear(flat, _out(num_classes)))
    return nn.Sequential(*layers)


STOCK: dict[str, Factory] = {"linear": linear, "mlp": mlp, "cnn": cnn, "cnn2": cnn2}


def register_model(name: str, factory: Factory) -> None:
    """Register a factory in this process (tests, notebooks); entry points need no call."""
    _REGISTERED[name] = factory


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group="coterie.models")}


def available_models() -> list[str]:
    return sorted(set(STOCK) | set(_REGISTERED) | set(_entry_points()))


def get_factory(name: str) -> Factory:
    if name in STOCK:
        return STOCK[name]
    if name in _REGISTERED:
        return _REGISTERED[name]
    eps = _entry_points()
    if name in eps:
        return eps[name].load()
    raise ValueError(f"unknown model {name!r}; available: {', '.join(available_models())}")


def build_model(name: str, input_shape, num_classes: int, **model_params) -> nn.Module:
    try:
        model = get_factory(name)(tuple(input_shape), int(num_classes), **model_params)
    except TypeError as e:  # wrong model_params
        raise ValueError(f"model {name!r}: bad model_params {sorted(model_params)}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {name!r} returned {type(model).__name__}, not nn.Module")
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"model {name!r} contains BatchNorm ({type(m).__name__}); use "
                f"GroupNorm or none: BN statistics cannot be mixed between peers"
            )
    return model
