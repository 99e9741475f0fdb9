"""Where a lone daemon's memory at rest lives (issue 34 item 2): one fresh ``coterie node start``
(local strategy, the ~21 MB MLP of bench/memory.py, Adam) runs its rounds; at rest it is read
from outside (``/proc/PID/smaps`` by kind of mapping, threads by name) and from inside (modules
loaded, glibc's arenas via ``malloc_info``, torch storages and numpy arrays reachable by gc).
Three fresh interpreters give the import baselines: bare python, ``import torch``, and every
module the daemon had loaded, imported in one go.

    python bench/memanatomy.py [--rounds 6] [--seed 0] [--out bench/results/memanatomy.json]

The daemon runs under this file (``--inside``), like bench/memprobe.py: a thread waits for a
trigger file, then writes its report; the daemon's code runs unchanged.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


# --- inside the daemon ------------------------------------------------------------------------


def malloc_info() -> dict[str, Any]:
    """glibc's own account: arenas, bytes it holds from the OS, bytes free inside them."""
    import ctypes
    import re

    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile() as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        xml = Path(f.name).read_text()
    tail = xml[xml.rfind("</heap>") :]  # the totals after the last arena
    total = {k: int(v) for k, v in re.findall(r'<(?:total|system) type="(\w+)" (?:count="\d+" )?size="(\d+)"', tail)}
    return {"arenas": xml.count("<heap nr="), "totals": total}


def holder_path(container: Any, owners: dict[int, str], objs: list[Any], depth: int = 4) -> str:
    """``Class.attr[key]...``: up to ``depth`` referrers from a container to an object's __dict__."""
    import gc

    if id(container) in owners:
        return owners[id(container)]
    if depth == 0:
        return type(container).__qualname__
    for r in gc.get_referrers(container):
        if r is objs or type(r).__name__ == "frame":
            continue
        if isinstance(r, dict):
            key = next((k for k, v in r.items() if v is container), None)
            if key is not None:
                return f"{holder_path(r, owners, objs, depth - 1)}.{key}"
        elif isinstance(r, (list, tuple)):
            return f"{holder_path(r, owners, objs, depth - 1)}[]"
        elif id(r) in owners or hasattr(type(r), "__slots__"):
            return f"{type(r).__qualname__}(slots)" if id(r) not in owners else owners[id(r)]
    return type(container).__qualname__


def storage_paths(max_depth: int = 9) -> dict[str, list[str]]:
    """The first attribute path from the live ``coterie.node.daemon.Node`` to each storage over
    1 MB: a breadth-first walk over attributes, dict items, list/tuple/set members and closures."""
    import gc

    import torch

    # the Node, then what it does not reach by attributes (the gRPC server's servicer is held by
    # grpc's C core): the served versions
    roots = [
        o
        for o in gc.get_objects()
        if (type(o).__name__, type(o).__module__)
        in (("Node", "coterie.node.daemon"), ("ServedVersions", "coterie.node.transport.served_versions"))
    ]
    roots.sort(key=lambda o: type(o).__name__ != "Node")
    seen: set[int] = set()
    found: dict[int, tuple[int, str]] = {}
    frontier: list[tuple[Any, str]] = [(r, type(r).__name__) for r in roots]
    for _ in range(max_depth):
        nxt: list[tuple[Any, str]] = []
        for obj, path in frontier:
            if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type, type(gc))):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                try:
                    st = obj.untyped_storage()
                    if st.nbytes() > 1e6 and st.data_ptr() not in found:
                        found[st.data_ptr()] = (st.nbytes(), path)
                except (RuntimeError, NotImplementedError):
                    pass
                continue
            if isinstance(obj, dict):
                nxt += [(v, f"{path}[{k!r:.40}]") for k, v in list(obj.items())]
            elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
                nxt += [(v, f"{path}[{i}]") for i, v in enumerate(list(obj))]
            else:
                try:
                    d = object.__getattribute__(obj, "__dict__")
                    if isinstance(d, dict):
                        nxt += [(v, f"{path}.{k}") for k, v in list(d.items())]
                except Exception:  # noqa: BLE001
                    pass
                for slot in (
                    getattr(type(obj), "__slots__", ())
                    if isinstance(getattr(type(obj), "__slots__", ()), tuple)
                    else ()
                ):
                    try:
                        nxt.append((object.__getattribute__(obj, slot), f"{path}.{slot}"))
                    except Exception:  # noqa: BLE001
                        pass
                if isinstance(obj, torch.nn.Module):
                    nxt += [(v, f"{path}.{k}") for k, v in obj.state_dict(keep_vars=True).items()]
                cells = getattr(obj, "__closure__", None)
                if cells:
                    for c in cells:
                        try:
                            nxt.append((c.cell_contents, f"{path}<closure>"))
                        except ValueError:  # an empty cell
                            pass
        frontier = nxt
    paths: dict[str, list[str]] = collections.defaultdict(list)
    for n, path in found.values():
        paths[path].append(f"{n / 1e6:.1f} MB")
    return dict(paths)


def reachable_tensors() -> dict[str, Any]:
    """Unique torch storages and numpy buffers reachable from gc-tracked objects, in MB."""
    import gc

    import numpy as np
    import torch

    storages: dict[int, int] = {}
    holders: dict[int, set[str]] = collections.defaultdict(set)  # storage -> who holds a tensor of it
    arrays: dict[int, int] = {}
    objs = gc.get_objects()
    owners: dict[int, str] = {}
    for o in objs:
        try:
            d = object.__getattribute__(o, "__dict__")
        except Exception:  # noqa: BLE001 - no __dict__, or a proxy that refuses
            continue
        if isinstance(d, dict):
            owners[id(d)] = type(o).__qualname__
    for o in objs:
        for x in (o, *gc.get_referents(o)):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                try:
                    s = x.untyped_storage()
                    if s.nbytes():
                        storages[s.data_ptr()] = s.nbytes()
                        if x is not o and s.nbytes() > 1e6:  # name the container by the path that holds it
                            holders[s.data_ptr()].add(holder_path(o, owners, objs))
                except (RuntimeError, NotImplementedError):
                    pass
            elif isinstance(x, np.ndarray):
                base = x
                while isinstance(base.base, np.ndarray):
                    base = base.base
                if base.base is None:  # owns its buffer (not a view of a torch tensor or bytes)
                    arrays[base.ctypes.data] = base.nbytes
    # torch.from_numpy / frombuffer tensors share an array's buffer (either may start inside the
    # other): such an array is counted once, as torch's
    spans = [(p, p + n) for p, n in storages.items()]

    def overlaps(a: int, n: int) -> bool:
        return any(lo < a + n and a < hi for lo, hi in spans)

    shared = {a for a, n in arrays.items() if overlaps(a, n)}
    arrays = {a: n for a, n in arrays.items() if a not in shared}
    return {
        "torch_storages": len(storages),
        "torch_storage_mb_sizes": sorted((round(n / 1e6, 1) for n in storages.values()), reverse=True)[:12],
        "large_storages": sorted(
            ([round(n / 1e6, 1), sorted(holders.get(p, ()))] for p, n in storages.items() if n > 1e6), reverse=True
        ),
        "numpy_shared_with_torch": len(shared),
        "torch_mb": round(sum(storages.values()) / 1e6, 1),
        "numpy_arrays": len(arrays),
        "numpy_mb": round(sum(arrays.values()) / 1e6, 1),
        "gc_objects": len(objs),
    }


def inside(trigger: Path, out: Path) -> None:
    while not trigger.exists():
        time.sleep(0.2)
    import ctypes

    rss = lambda: rollup(os.getpid())["Rss"]  # noqa: E731
    before = rss()
    ctypes.CDLL(None).malloc_trim(0)
    report = {
        "rss_trim_mb": [before, rss()],  # what one more malloc_trim would give back at rest
        "modules": sorted(sys.modules),
        "malloc": malloc_info(),
        "reachable": reachable_tensors(),
        "storage_paths": storage_paths(),
        "python_blocks": sys.getallocatedblocks(),
    }
    try:
        import torch

        report["torch_threads"] = [torch.get_num_threads(), torch.get_num_interop_threads()]
    except ImportError:
        pass
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out)


# --- outside ----------------------------------------------------------------------------------


def kind(name: str, size_kb: int) -> str:
    if name == "[heap]":
        return "heap (main arena)"
    if name.startswith("[stack"):
        return "main stack"
    if name.startswith("["):
        return "kernel ([vdso] etc.)"
    if name.startswith("/"):
        base = os.path.basename(name)
        if ".so" in base:
            return "shared libraries" + (" (torch)" if "torch" in name else "")
        if name.endswith(".pyc") or name.endswith(".py"):
            return "python files"
        return "other files"
    if size_kb in (64 * 1024, 128 * 1024, 132 * 1024):  # glibc's per-thread arenas: 64 MiB heaps
        return "anon 64 MiB (glibc thread arenas)"
    if size_kb >= 1024:
        return "anon >= 1 MiB (large mallocs, thread stacks, torch)"
    return "anon < 1 MiB (pymalloc arenas, small mmaps)"


def smaps_by_kind(pid: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    name, size = "", 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            name = parts[5] if len(parts) > 5 else ""
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            size = (hi - lo) // 1024
            # glibc's 64 MiB arena heaps are mapped in two parts (rw + PROT_NONE): judge by address alignment
            if not name and lo % (64 << 20) == 0:
                size = 64 * 1024
            out[kind(name, size)]["mappings"] += 1
        elif parts[0] in ("Rss:", "Pss:", "Private_Dirty:", "Private_Clean:", "Swap:"):
            out[kind(name, size)][parts[0][:-1]] += int(parts[1]) / 1024
    return {k: {m: round(v, 1) for m, v in d.items()} for k, d in out.items()}


def threads(pid: int) -> dict[str, int]:
    names = collections.Counter()
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            names[(t / "comm").read_text().strip()] += 1
        except OSError:
            pass
    return dict(names.most_common())


def rollup(pid: int) -> dict[str, float]:
    vals = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, v, *_ = line.split()
        vals[k[:-1]] = round(int(v) / 1024, 1)
    return {k: vals[k] for k in ("Rss", "Pss", "Private_Dirty", "Private_Clean", "Anonymous") if k in vals}


def baseline(python: str, code: str) -> dict[str, float]:
    """Rollup of a fresh interpreter that ran ``code`` and then waits to be read."""
    p = subprocess.Popen(
        [python, "-c", code + "\nimport sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        return rollup(p.pid)
    finally:
        p.stdin.close()
        p.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inside", nargs=2, metavar=("TRIGGER", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", default="2280,2280")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", default="local", help="node 0's strategy (and its peers')")
    ap.add_argument("--nodes", type=int, default=1, help="a network of this many; node 0 is the one dissected")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--python", default=sys.executable, help="the interpreter (checkout) to run the daemon under")
    ap.add_argument(
        "--fresh-cache",
        action="store_true",
        help="an empty dataset cache (XDG_CACHE_HOME): the daemon generates its pool, as on a device's first start",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "memanatomy.json")
    args, rest = ap.parse_known_args()
    if args.inside:  # we are the daemon: report on the trigger, run coterie's CLI as usual
        threading.Thread(target=inside, args=(Path(args.inside[0]), Path(args.inside[1])), daemon=True).start()
        if rest and os.path.basename(rest[0]).startswith("python"):  # netlab's wrap: the interpreter follows
            rest = rest[1:]
        if rest[:2] == ["-m", "coterie.cli.main"]:
            rest = rest[2:]
        import runpy

        sys.argv = ["coterie", *rest]
        runpy.run_module("coterie.cli.main", run_name="__main__", alter_sys=True)
        return 0

    sys.path.insert(0, str(HERE))
    from netlab import Lab, mnist1d_mlp, wait_for  # noqa: E402

    hidden = [int(h) for h in args.hidden.split(",")]
    root = Path(tempfile.mkdtemp(prefix="coterie-anatomy-"))
    if args.fresh_cache:
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")
    trigger, report_path = root / "trigger", root / "inside.json"
    cfgs = [
        {
            "strategy": args.strategy,
            "rounds": args.rounds,
            "round_interval_s": 0.0,
            "min_peers": args.nodes - 1,
            "seed": args.seed,
            "log_level": "WARNING",
            # node i of bench/memory.py's 4 (or of a network of --nodes, when larger)
            "learner": mnist1d_mlp(max(4, args.nodes), i, hidden=hidden, steps=args.steps),
        }
        for i in range(args.nodes)
    ]
    cfg = cfgs[0]
    wrap = [args.python, __file__, "--inside", str(trigger), str(report_path)]
    with Lab(root, cfgs, wraps=[wrap] + [[]] * (args.nodes - 1), python=args.python) as lab:
        lab.start(seeds=1)
        pid = lab.nodes[0].proc.pid
        wait_for(
            lambda: all(s and s.get("done") for s in lab.statuses()), args.timeout, "the nodes to finish", interval=1.0
        )
        time.sleep(2.0)  # the last checkpoint's write and trim
        outside = {"rollup": rollup(pid), "smaps": smaps_by_kind(pid), "threads": threads(pid)}
        trigger.touch()
        wait_for(report_path.exists, 120, "the daemon's own report")
        inner = json.loads(report_path.read_text())
        outside["rollup_after_report"] = rollup(pid)
    mods = [m for m in inner["modules"] if "." not in m]
    loaded = inner["modules"]
    code = f"import importlib\nfor m in {loaded!r}:\n    try: importlib.import_module(m)\n    except Exception: pass"
    base = {
        "python": baseline(args.python, "pass"),
        "import torch": baseline(args.python, "import torch"),
        "every module the daemon loaded": baseline(args.python, code),
    }
    heavy = [m for m in ("sklearn", "scipy", "pandas", "matplotlib", "PIL", "torchvision", "sympy") if m in mods]
    result = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "node": cfg},
        "daemon": outside,
        "inside": {k: v for k, v in inner.items() if k != "modules"},
        "modules_loaded": len(inner["modules"]),
        "top_level_packages": mods,
        "heavy_packages_loaded": heavy,
        "baselines": base,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    r = outside["rollup"]
    print(f"daemon at rest: RSS {r['Rss']} MB, PSS {r['Pss']} MB, private dirty {r['Private_Dirty']} MB")
    for k, v in sorted(outside["smaps"].items(), key=lambda kv: -kv[1].get("Pss", 0)):
        print(f"  {k:<55} PSS {v.get('Pss', 0):7.1f}  RSS {v.get('Rss', 0):7.1f}  mappings {int(v['mappings'])}")
    print(f"threads: {outside['threads']}")
    print(f"inside: {json.dumps(result['inside'])}")
    print(f"heavy packages loaded: {heavy}; modules {len(inner['modules'])}")
    for path, sizes in sorted(inner.get("storage_paths", {}).items()):
        print(f"  held: {path}: {', '.join(sizes)}")
    for k, v in base.items():
        print(f"baseline {k:<32} RSS {v['Rss']:7.1f}  PSS {v['Pss']:7.1f}  private dirty {v['Private_Dirty']:7.1f}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
