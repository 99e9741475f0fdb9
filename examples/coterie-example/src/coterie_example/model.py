"""``sensor-net``: a model for vectors of sensor readings (group ``coterie.models``).

Contract: ``factory(input_shape, num_classes, **model_params) -> nn.Module``; ``num_classes == 0``
means regression (one output). No BatchNorm: its running statistics cannot be averaged between
peers (Coterie refuses a model that has it). LayerNorm normalises each sample on its own, so a
device's raw scale does not matter and nothing per-device is stored outside the parameters."""

from __future__ import annotations

from torch import nn


def sensor_net(input_shape, num_classes: int, hidden: int = 32, depth: int = 1) -> nn.Module:
    features = 1
    for s in input_shape:
        features *= int(s)
    if int(hidden) < 1 or int(depth) < 1:
        raise ValueError(f"sensor-net: hidden and depth must be >= 1, got {hidden}, {depth}")
    layers: list[nn.Module] = [nn.Flatten(), nn.LayerNorm(features)]
    width = features
    for _ in range(int(depth)):
        layers += [nn.Linear(width, int(hidden)), nn.GELU()]
        width = int(hidden)
    layers.append(nn.Linear(width, num_classes if num_classes > 0 else 1))
    return nn.Sequential(*layers)
