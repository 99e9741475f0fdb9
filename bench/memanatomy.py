"""Where a lone daemon's memory at rest lives (issue 34 item 2): one fresh ``coterie node start``
(local strategy, the ~21 MB MLP of bench/memory.py, Adam) runs its rounds; at rest it is read
from outside (``/proc/PID/smaps`` by kind of mapping, threads by name) and from inside (modules
loaded, glibc's arenas via ``malloc_info``, torch storages and numpy arrays reachable by gc).
Three fresh interpreters give the import baselines: bare python, ``import torch``, and every
module the daemon had loaded, imported in one go.

    python bench/memanatomy.py [--rounds 6] [--seed 0] [--out bench/results/memanatomy.json]
    python bench/memanatomy.py --strategy dpsgd --nodes 4 --no-baselines --out OUT.json

With ``--nodes N`` a network of N daemons (bench/memory.py's) runs, and every one is read. Each
report also attributes the model-sized buffers (torch storages, bytes of 1 MiB or more) to the
node object holding them (``owned_buffers``: learner, held peer versions, served versions,
published snapshot, cache, strategy, guard, checkpointer), with the chain of types from owner
to buffer: where D-PSGD's extra lives (bench/results/memory.md).

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


def reachable_tensors() -> dict[str, Any]:
    """Unique torch storages and numpy buffers reachable from gc-tracked objects, in MB."""
    import gc

    import numpy as np
    import torch

    storages: dict[int, int] = {}
    arrays: dict[int, int] = {}
    objs = gc.get_objects()
    for o in objs:
        for x in (o, *gc.get_referents(o)):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                try:
                    s = x.untyped_storage()
                    if s.nbytes():
                        storages[s.data_ptr()] = s.nbytes()
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
        "numpy_shared_with_torch": len(shared),
        "torch_mb": round(sum(storages.values()) / 1e6, 1),
        "numpy_arrays": len(arrays),
        "numpy_mb": round(sum(arrays.values()) / 1e6, 1),
        "gc_objects": len(objs),
    }


# the objects a node's model-sized buffers may belong to: each is a barrier of the walk below, so
# a buffer is counted once, under the nearest owner (the learner a reference holds is its own owner)
OWNERS = (
    "Learner",
    "Optimizer",
    "LocalReference",
    "HeldVersions",
    "ServedVersions",
    "SnapshotCache",
    "PublishBoard",
    "Strategy",
    "Checkpointer",
    "RoundGuard",
)
BIG = 1 << 20  # buffers under 1 MiB are not model-sized (the 21 MB MLP's smallest layer is 0.36 MB)


def owned_buffers(frames: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Model-sized torch storages and bytes objects (>= 1 MiB) by the node object that holds them:
    a walk over gc referents from every instance of ``OWNERS`` (by class or base class name) that
    stops at other owners, modules, classes and functions. What no owner reaches is "unowned"
    (e.g. a buffer only a running frame or a gRPC message holds). ``frames``: before calling the
    rest unowned, the locals of every thread's running frames and of every suspended coroutine
    are walked (the transients of a round in progress: "frame <function>: <variable>");
    ``extra``: more holders by label (a probe's own result, say), walked first."""
    import gc
    import types

    import torch

    def owner_name(o: Any) -> str | None:
        if isinstance(o, type):
            return None
        names = [c.__name__ for c in type(o).__mro__]
        return next((n for n in OWNERS if n in names), None)

    objs = gc.get_objects()
    owners = [(o, owner_name(o)) for o in objs]
    owners = [(o, n) for o, n in owners if n is not None]
    owner_ids = {id(o) for o, _ in owners}
    stop = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType)

    import numpy as np

    def buf_of(x: Any) -> tuple[int, int, str] | None:
        """(address, bytes, kind) of a big buffer: a tensor's storage, or a bytes-like object's."""
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            try:
                s = x.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return None
            return (s.data_ptr(), s.nbytes(), "tensor") if s.nbytes() >= BIG else None
        if isinstance(x, (bytes, bytearray, memoryview)) and memoryview(x).nbytes >= BIG:
            return np.frombuffer(x, dtype=np.uint8).ctypes.data, memoryview(x).nbytes, "bytes"
        return None

    spans: list[tuple[int, int]] = []  # claimed buffers: a tensor viewing a claimed bytes is not counted twice

    def claim(b: tuple[int, int, str]) -> bool:
        if any(lo <= b[0] < hi for lo, hi in spans):
            return False
        spans.append((b[0], b[0] + b[1]))
        return True

    def path(parents: dict[int, Any], x: Any, root: Any) -> str:
        """Type names from the owner down to the buffer (what holds it)."""
        names = []
        while x is not None and x is not root and len(names) < 12:
            names.append(type(x).__name__)
            x = parents.get(id(x))
        return " <- ".join(names)

    by_owner: dict[str, dict[str, Any]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for o, name in owners:
        label = f"{name} ({type(o).__name__})" if type(o).__name__ != name else name
        parents: dict[int, Any] = {}
        seen, todo = {id(o)}, [(r, o) for r in gc.get_referents(o)]
        while todo:
            x, parent = todo.pop()
            if id(x) in seen or id(x) in owner_ids or isinstance(x, stop):
                continue
            seen.add(id(x))
            parents[id(x)] = parent
            b = buf_of(x)
            if b is not None:
                if claim(b):
                    by_owner[label][b[2] + "_mb"] += b[1] / 1e6
                    by_owner[label][b[2] + "s"] += 1
                    by_owner[label].setdefault("paths", [])  # type: ignore[arg-type]
                    by_owner[label]["paths"].append(f"{b[1] / 1e6:.1f} MB {path(parents, x, o)}")
                continue
            todo.extend((r, x) for r in gc.get_referents(x))
        by_owner[label]["instances"] += 0  # listed even when it holds nothing big

    def walk_value(label: str, value: Any, depth: int = 3) -> None:
        """A frame local: the buffers it holds directly or in containers (a dict of tensors)."""
        todo, seen = [(value, 0)], set()
        while todo:
            x, d = todo.pop()
            if id(x) in seen or id(x) in owner_ids or isinstance(x, stop):
                continue
            seen.add(id(x))
            b = buf_of(x)
            if b is not None:
                if claim(b):
                    by_owner[label][b[2] + "_mb"] += b[1] / 1e6
                    by_owner[label][b[2] + "s"] += 1
                continue
            if (
                d < depth
                and isinstance(x, (dict, list, tuple, set, types.CellType))
                or hasattr(x, "__dict__")
                and d < 1
            ):
                todo.extend((r, d + 1) for r in gc.get_referents(x))

    if frames:
        import inspect
        import sys as _sys

        here = __file__
        for label, value in (extra or {}).items():
            walk_value(label, value)
        # suspended coroutines and generators: their locals by gc. Reading ``f_locals`` of every
        # frame instead left what it read alive, in cells no object refers to (Python 3.11, cause
        # not pinned down): 21 model-sized buffers, 421 MB, still held at rest after 11 probes;
        # read this way (and running frames with cells skipped), none
        for o in objs:
            if isinstance(o, (types.CoroutineType, types.GeneratorType)):
                for value in gc.get_referents(o):
                    walk_value(f"coroutine {o.__qualname__}", value)
        # running frames (worker threads): ``f_locals``, for functions without cells only (see
        # above; what such a frame holds shows as "unowned")
        for f in _sys._current_frames().values():
            while f is not None:
                code = f.f_code
                if (
                    code.co_filename != here  # (not this probe's own frames)
                    and code.co_flags & inspect.CO_OPTIMIZED  # (a module's locals are its globals)
                    and not code.co_cellvars
                    and not code.co_freevars
                ):
                    snapshot = f.f_locals  # Python < 3.13 caches this dict on the frame: emptied
                    local = list(snapshot.items())  # after reading, so that the probe keeps nothing
                    snapshot.clear()
                    for var, value in local:
                        walk_value(f"frame {code.co_name}: {var}", value)
                    del local
                f = f.f_back
    counted = collections.Counter(name for _, name in owners)
    unowned: dict[str, float] = collections.defaultdict(float)
    unowned_by: list[str] = []

    def referrers(x: Any, skip: set[int], depth: int = 6) -> str:
        """What holds an unowned buffer: a chain of referrer types (the first referrer at each step)."""
        names = [type(x).__name__]
        skip = set(skip)
        for _ in range(depth):
            refs = [r for r in gc.get_referrers(x) if id(r) not in skip]
            skip.add(id(refs))  # (this list refers to x too)
            if not refs:
                break
            x = refs[0]
            label = type(x).__name__
            if isinstance(x, (types.CoroutineType, types.GeneratorType, types.FunctionType)):
                label += f"[{x.__qualname__}]"
            elif isinstance(x, types.FrameType):
                label += f"[{x.f_code.co_name} {x.f_code.co_filename.rsplit('/', 1)[-1]}:{x.f_lineno}]"
            names.append(label)
            if isinstance(x, (types.FrameType, types.CoroutineType, types.FunctionType)):
                break
        return " <- ".join(names)

    for o in objs:
        group = (o, *gc.get_referents(o))
        for x in group:
            b = buf_of(x)
            if b is not None and claim(b):
                unowned[b[2] + "_mb"] += b[1] / 1e6
                unowned[b[2] + "s"] += 1
                unowned_by.append(f"{b[1] / 1e6:.1f} MB {referrers(x, {id(objs), id(group)})}")
    out = {
        k: {m: (v if m == "paths" else round(v, 1)) for m, v in d.items() if m != "instances"}
        for k, d in by_owner.items()
    }
    out["unowned"] = {m: round(v, 1) for m, v in unowned.items()}
    out["unowned"]["held_by"] = unowned_by  # type: ignore[assignment]
    return {"by_owner": out, "owner_instances": dict(counted)}


# --- while exchanging: probes at the moments of a round that hold the most -------------------

PROBE_ROUND = 3  # the round probed (the exchange in full swing: every peer has published twice)
_probe: dict[str, Any] = {"round": 0, "done": collections.Counter(), "reports": [], "lock": threading.Lock()}


def probe(phase: str, times: int = 1, **extra: Any) -> None:
    """At ``phase`` of the probed round (its first ``times`` occurrences), what holds every
    model-sized buffer, and the process's RSS and PSS at that moment. Runs in the thread that
    reached the phase (the others go on meanwhile: a probe takes a second or two)."""
    if _probe["round"] != PROBE_ROUND or _probe["done"][phase] >= times:
        return
    with _probe["lock"]:
        if _probe["done"][phase] >= times:
            return
        _probe["done"][phase] += 1
        if times > 1:
            phase = f"{phase} (#{_probe['done'][phase]})"
        t0 = time.monotonic()
        mem = rollup(os.getpid())
        owned = owned_buffers(frames=True, extra={f"probe {phase}: {k}": v for k, v in extra.items()})
        _probe["reports"].append(
            {"phase": phase, "rss_mb": mem["Rss"], "pss_mb": mem["Pss"], "owned": owned, "probe_s": 0.0}
        )
        _probe["reports"][-1]["probe_s"] = round(time.monotonic() - t0, 2)


def install_probes() -> None:
    """Wrap the calls at which a D-PSGD round holds its transients (the daemon's code unchanged):
    after an optimizer step (gradients, Adam's state), the trained copy taken, each pulled model
    about to be added (decoded, its payload maybe still alive), the sum scaled, the published
    snapshot encoded (its groups and the new buffer), the server's delta encode (the payload, its
    base), the checkpoint's staging (learner state copied, about to be written)."""
    from coterie.node import checkpointing, rounds
    from coterie.node.learning import local_optim, torch_learner
    from coterie.node.peering import messages
    from coterie.node.wire import codecs

    def around(owner: Any, name: str, before: str | None = None, after: str | None = None, times: int = 1) -> None:
        real = getattr(owner, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            if before:
                probe(before, times, argument=a[1] if len(a) > 1 else None)
            out = real(*a, **kw)
            if after:
                probe(after, times, result=out)
            return out

        setattr(owner, name, wrapped)

    real_one = rounds.RoundLoop.one

    async def one(self: Any, rnd: int, t0: float) -> Any:
        _probe["round"] = rnd
        return await real_one(self, rnd, t0)

    rounds.RoundLoop.one = one
    around(local_optim.LocalOptimizer, "step", after="training: after an optimizer step")
    around(torch_learner.TorchLearner, "train", before="training: about to start")
    around(torch_learner.TorchLearner, "get_params", after="a copy of the model taken (get_params)", times=2)
    around(torch_learner.TorchLearner, "add_to_params", before="a pulled model about to be added", times=3)
    around(torch_learner.TorchLearner, "scale_params", before="every pulled model added, about to scale")
    around(messages, "encode_buffer", after="the published snapshot encoded")
    real_encode = codecs.encode

    def encode(*a: Any, **kw: Any) -> Any:
        out = real_encode(*a, **kw)
        probe("the server encoded a delta" if kw.get("base") is not None else "the server encoded whole", result=out)
        return out

    codecs.encode = encode
    around(checkpointing.Checkpointer, "_write", before="checkpoint staged, about to be written")


def inside(trigger: Path, out: Path) -> None:
    while not trigger.exists():
        time.sleep(0.2)
    import ctypes

    rss = lambda: rollup(os.getpid())["Rss"]  # noqa: E731
    before = rss()
    ctypes.CDLL(None).malloc_trim(0)
    owned = owned_buffers()  # before the other reports' own allocations
    report = {
        "owned": owned,
        "rss_trim_mb": [before, rss()],  # what one more malloc_trim would give back at rest
        "modules": sorted(sys.modules),
        "malloc": malloc_info(),
        "reachable": reachable_tensors(),
        "python_blocks": sys.getallocatedblocks(),
        "phases": _probe["reports"],
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
    ap.add_argument("--strategy", default="local")
    ap.add_argument("--nodes", type=int, default=1, help="a network of N daemons (min_peers N-1), each read")
    ap.add_argument("--sample-s", type=float, default=0.5)
    ap.add_argument("--no-baselines", action="store_true", help="skip the three import-baseline interpreters")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", default="2280,2280")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--python", default=sys.executable, help="the interpreter (checkout) to run the daemon under")
    ap.add_argument(
        "--fresh-cache",
        action="store_true",
        help="an empty dataset cache (XDG_CACHE_HOME): the daemon generates its pool, as on a device's first start",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help=f"also read each daemon while it exchanges: probes at the moments of round {PROBE_ROUND} that hold the most",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "memanatomy.json")
    args, rest = ap.parse_known_args()
    if args.inside:  # we are the daemon: report on the trigger, run coterie's CLI as usual
        if os.environ.get("MEMANATOMY_PHASES") == "1":
            install_probes()
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
    from memory import Sampler  # noqa: E402
    from netlab import Lab, mnist1d_mlp, wait_for  # noqa: E402

    hidden = [int(h) for h in args.hidden.split(",")]
    root = Path(tempfile.mkdtemp(prefix="coterie-anatomy-"))
    if args.phases:
        os.environ["MEMANATOMY_PHASES"] = "1"  # (the daemons inherit it)
    if args.fresh_cache:
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")
    n = args.nodes
    trigger = root / "trigger"
    reports = [root / f"inside-{i}.json" for i in range(n)]
    cfgs = [
        {
            "strategy": args.strategy,
            "rounds": args.rounds,
            "round_interval_s": 0.0,
            "min_peers": n - 1,
            "seed": args.seed,
            "log_level": "WARNING",
            # node 0 of bench/memory.py's 4 when alone; its network of n otherwise
            "learner": mnist1d_mlp(max(n, 4) if n == 1 else n, i, hidden=hidden, steps=args.steps),
        }
        for i in range(n)
    ]
    wraps = [[args.python, __file__, "--inside", str(trigger), str(r)] for r in reports]
    with Lab(root, cfgs, wraps=wraps, python=args.python, fork=False) as lab:
        lab.start(seeds=1)
        pids = [d.proc.pid for d in lab.nodes]
        sampler = Sampler(pids, args.sample_s)  # each node's peak PSS while it runs its rounds
        sampler.start()
        wait_for(
            lambda: all(s and s.get("done") for s in lab.statuses()),
            args.timeout,
            f"{n} node(s) to finish",
            interval=1.0,
        )
        time.sleep(2.0)  # the last checkpoint's write and trim
        sampler.halt.set()
        sampler.join()
        outside = [{"rollup": rollup(p), "smaps": smaps_by_kind(p), "threads": threads(p)} for p in pids]
        for i, o in enumerate(outside):
            o["peak_pss_mb"] = round(max(s[i][0] for s in sampler.samples), 1)
        trigger.touch()
        wait_for(lambda: all(r.exists() for r in reports), 300, "the daemons' own reports")
        inners = [json.loads(r.read_text()) for r in reports]
        for p, o in zip(pids, outside, strict=True):
            o["rollup_after_report"] = rollup(p)
    inner = inners[0]
    mods = [m for m in inner["modules"] if "." not in m]
    loaded = inner["modules"]
    code = f"import importlib\nfor m in {loaded!r}:\n    try: importlib.import_module(m)\n    except Exception: pass"
    base = (
        {}
        if args.no_baselines
        else {
            "python": baseline(args.python, "pass"),
            "import torch": baseline(args.python, "import torch"),
            "every module the daemon loaded": baseline(args.python, code),
        }
    )
    heavy = [m for m in ("sklearn", "scipy", "pandas", "matplotlib", "PIL", "torchvision", "sympy") if m in mods]
    result = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "nodes": cfgs},
        "daemon": outside[0],
        "inside": {k: v for k, v in inner.items() if k != "modules"},
        "daemons": outside,
        "insides": [{k: v for k, v in x.items() if k != "modules"} for x in inners],
        "modules_loaded": len(inner["modules"]),
        "top_level_packages": mods,
        "heavy_packages_loaded": heavy,
        "baselines": base,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for i, (o, x) in enumerate(zip(outside, inners, strict=True)):
        r = o["rollup"]
        print(f"n{i} at rest: RSS {r['Rss']} PSS {r['Pss']} MB (peak PSS {o['peak_pss_mb']}); trim {x['rss_trim_mb']}")
        for k, v in sorted(x["owned"]["by_owner"].items()):
            if v:
                print(f"    {k:<40} {json.dumps(v)}")
    for ph in inner.get("phases", []):
        print(f"n0 round {PROBE_ROUND}, {ph['phase']}: RSS {ph['rss_mb']} PSS {ph['pss_mb']} ({ph['probe_s']} s)")
        for k, v in sorted(ph["owned"]["by_owner"].items()):
            if v:
                print(f"    {k:<60} {json.dumps({m: x for m, x in v.items() if m not in ('paths', 'held_by')})}")
    r = outside[0]["rollup"]
    print(f"n0 at rest: RSS {r['Rss']} MB, PSS {r['Pss']} MB, private dirty {r['Private_Dirty']} MB")
    for k, v in sorted(outside[0]["smaps"].items(), key=lambda kv: -kv[1].get("Pss", 0)):
        print(f"  {k:<55} PSS {v.get('Pss', 0):7.1f}  RSS {v.get('Rss', 0):7.1f}  mappings {int(v['mappings'])}")
    print(f"threads: {outside[0]['threads']}")
    print(f"inside: {json.dumps(result['inside'])}")
    print(f"heavy packages loaded: {heavy}; modules {len(inner['modules'])}")
    for k, v in base.items():
        print(f"baseline {k:<32} RSS {v['Rss']:7.1f}  PSS {v['Pss']:7.1f}  private dirty {v['Private_Dirty']:7.1f}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
