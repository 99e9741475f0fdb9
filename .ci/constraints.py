"""Write constraints.txt: the installed version of every package in Coterie's dependency closure.

    python .ci/constraints.py [--extras test,ray,docs] [--out constraints.txt]

Walks the requirements of the installed `coterie` distribution (with the given extras) through
importlib.metadata, following each requirement whose environment marker holds here, and pins
each package to the version installed in this environment. Use it with
`pip install -c constraints.txt -e '.[test,ray,docs]'` to install the set that was tested.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(root: str, extras: set[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The installed version of every package ``root[extras]`` needs, and what each is required as."""
    pins: dict[str, str] = {}
    wanted: dict[str, list[str]] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, ex = todo.pop()
        if (name, ex) in seen:
            continue
        seen.add((name, ex))
        dist = md.distribution(name)
        key = canonicalize_name(dist.metadata["Name"])
        if key != canonicalize_name(root):
            pins[key] = dist.version
        for raw in dist.requires or []:
            req = Requirement(raw)
            envs = [{"extra": e} for e in ex] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in envs):
                continue
            try:
                md.distribution(req.name)
            except md.PackageNotFoundError:
                raise SystemExit(f"{req.name} (needed by {name}) is not installed: install the extras first") from None
            wanted.setdefault(canonicalize_name(req.name), []).append(f"{name} needs {req}")
            todo.append((req.name, frozenset(req.extras)))
    return pins, wanted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="test,ray,docs")
    ap.add_argument("--out", default="constraints.txt")
    args = ap.parse_args()
    extras = {e for e in args.extras.split(",") if e}
    pins, wanted = closure("coterie", extras)
    # a pin that breaks a requirement in the closure (e.g. a venv's own old setuptools shadowing the
    # system's) would make the file uninstallable: leave that package to pip and say so
    broken = {}
    for k, v in pins.items():
        bad = [
            w
            for w in wanted.get(k, [])
            if not Requirement(w.split(" needs ", 1)[1]).specifier.contains(v.split("+")[0], prereleases=True)
        ]
        if bad:
            broken[k] = f"# {k} not pinned: {v} is installed here, but " + "; ".join(bad)
    head = [
        f"# coterie[{','.join(sorted(extras))}]'s dependency closure as installed and tested",
        f"# (python {platform.python_version()}, {sys.platform}); regenerate: python .ci/constraints.py",
        "# use: python3 -m pip install -c constraints.txt -e '.[test,ray,docs]'",
    ]
    lines = []
    for k, v in sorted(pins.items()):
        v = v.split("+")[0]  # torch 2.13.0+cpu: the local label names the build, pip matches 2.13.0
        lines.append(broken[k] if k in broken else f"{k}=={v}")
    Path(args.out).write_text("\n".join(head + lines) + "\n")
    print(f"{len(lines) - len(broken)} pins -> {args.out}" + "".join(f"\n{b}" for b in broken.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
