"""Time of an Adam step and of the divergence guard's finiteness check, in chunks of a tensor
(``local_optim.STEP_CHUNK``, ``guard.FINITE_CHUNK``) against the whole tensor at once (the
chunk set beyond any tensor's size: main's formula), side by side in one process, alternating,
on the ~21 MB MLP's parameters (40-2280-2280-10). Prints the median time of each and the median
of the per-pair ratios; writes every timing and the full config to ``--out``.

    python bench/adamstep.py --seed 0 --pairs 40
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from coterie.node.learning import guard, local_optim


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a node's learner.torch_threads)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "adamstep.json")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    sizes = [40, 2280, 2280, 10]
    params = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        params += [
            (f"w{i}", torch.nn.Parameter(torch.randn(b, a) * 0.02)),
            (f"b{i}", torch.nn.Parameter(torch.zeros(b))),
        ]
    opt = local_optim.LocalOptimizer("adam", params, lr=1e-3)
    whole, chunked, finite_chunk = 1 << 62, local_optim.STEP_CHUNK, guard.FINITE_CHUNK

    def step(chunk: int) -> float:
        local_optim.STEP_CHUNK = chunk
        for _, p in params:
            p.grad = torch.randn_like(p) * 1e-3
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    def check(chunk: int) -> float:
        guard.FINITE_CHUNK = chunk
        t0 = time.perf_counter()
        assert guard.all_finite(dict(params))
        return time.perf_counter() - t0

    out: dict[str, dict[str, list[float]]] = {}
    for what, fn, default in (("adam step", step, chunked), ("finite check", check, finite_chunk)):
        for _ in range(3):  # warm up both
            fn(whole), fn(default)
        times: dict[str, list[float]] = {"whole": [], "chunked": []}
        for i in range(args.pairs):
            order = [("whole", whole), ("chunked", default)]
            for label, chunk in order if i % 2 == 0 else reversed(order):
                times[label].append(fn(chunk))
        ratios = [c / w for c, w in zip(times["chunked"], times["whole"], strict=True)]
        out[what] = {**times, "ratio": ratios}
        print(
            f"{what:<13} whole tensor {statistics.median(times['whole']) * 1e3:7.2f} ms, in chunks "
            f"{statistics.median(times['chunked']) * 1e3:7.2f} ms; chunked/whole per pair: median "
            f"{statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cfg.update(step_chunk=chunked, finite_chunk=finite_chunk, sizes=sizes, torch=torch.__version__)
    args.out.write_text(json.dumps({"config": cfg, "seconds": out}, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
