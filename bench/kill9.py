"""kill -9 a real node daemon at random moments; every restart must resume exactly.

Each trial starts the node (a separate process: solo, strategy local, Adam, MNIST-1D MLP) on the
same state dir, waits a random time (a quarter of the trials during start-up, the rest once it
has checkpointed a round of its own: mid-round, mid-commit), SIGKILLs it, and checks:
  1. the state dir opens: the newest checkpoint verifies, and the node is never left with
     identity or history but no checkpoint;
  2. no checkpointed round is lost: the checkpoint is at least the last round /status showed;
  3. the checkpoint holds exactly the weights the node published for that round (the snapshot
     sha256 in that round's history line, recomputed from the checkpoint's tensors);
  4. the history is rounds 1..r, no gap, no duplicate.
After the last kill the node runs a few more rounds, and the snapshot sha256 of every round in
its history (written by 1 + kills processes) is compared with an uninterrupted reference run of
the same config: equal means every resume continued exactly (optimizer moments, minibatch order).

    python bench/kill9.py --kills 36 --seed 0      # writes bench/results/kill9.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import tomli_w

from coterie.node.admin_token import bearer, token_for_state_dir
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.persistence import StateError, StateStore
from coterie.node.wire.codec import encode

LEARNER = {
    "dataset": "mnist1d",
    "dataset_params": {"num_samples": 2000},
    "partition": "iid",
    "num_nodes": 1,
    "model": "mlp",
    "optimizer": "adam",
    "lr": 0.003,
    "local_steps": 10,
}


def node_config(state_dir: Path, rounds: int | None, seed: int) -> dict[str, Any]:
    cfg = {
        "node_id": "k9",
        "state_dir": str(state_dir),
        "strategy": "local",
        "min_peers": 0,
        "security": {"insecure": True},
        "round_interval_s": 0.0,
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "seed": seed,
        "learner": {**LEARNER, "init_seed": seed, "data_seed": seed},
        "log_level": "WARNING",
    }
    if rounds is not None:
        cfg["rounds"] = rounds
    return cfg


def spawn(workdir: Path, cfg: dict[str, Any], name: str) -> subprocess.Popen:
    path = workdir / f"{name}.toml"
    path.write_text(tomli_w.dumps(cfg))
    log = open(workdir / f"{name}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "coterie.cli.main", "node", "start", "--config", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def admin_status(state_dir: Path, pid: int) -> dict[str, Any] | None:
    try:
        info = json.loads((state_dir / "node.json").read_text())
        if info.get("pid") != pid:
            return None
        req = urllib.request.Request(info["admin_url"] + "/status", headers=bearer(token_for_state_dir(state_dir)))
        with urllib.request.urlopen(req, timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError, KeyError):
        return None


def run_to_completion(workdir: Path, state_dir: Path, rounds: int, seed: int, name: str, timeout: float) -> None:
    p = spawn(workdir, node_config(state_dir, rounds, seed), name)
    deadline = time.monotonic() + timeout
    try:
        while not (admin_status(state_dir, p.pid) or {}).get("done"):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} exited or timed out; see {workdir / (name + '.log')}")
            time.sleep(0.1)
    finally:
        p.terminate()
        p.wait(timeout=60)


def history_rounds(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "history.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def check_after_kill(state_dir: Path, durable_seen: int, learner) -> tuple[bool, str, int]:
    """Checks 1-4 on the state a kill left; (ok, why, checkpointed round)."""
    try:
        _, ckpt = StateStore(state_dir).open("k9")  # what the next start does, crash repairs included
    except StateError as e:
        return False, f"state dir does not open: {e}", -1
    if ckpt is None:
        return (durable_seen <= 0, "fresh (killed before the first checkpoint)", 0)
    if ckpt.round < durable_seen:
        return False, f"lost round: checkpoint {ckpt.round} < {durable_seen} shown by /status", ckpt.round
    rounds = [h["round"] for h in history_rounds(state_dir)]
    if rounds != list(range(1, ckpt.round + 1)):
        return False, f"history rounds {rounds[:3]}..{rounds[-3:]} for checkpoint {ckpt.round}", ckpt.round
    if ckpt.round:
        learner.import_state(*ckpt.learner_state())
        data = encode({"params": learner.get_params()}, {"node_id": "k9", "version": ckpt.version, "round": ckpt.round})
        want = history_rounds(state_dir)[-1]["snapshot_sha256"]
        if hashlib.sha256(data).hexdigest() != want:
            return False, f"checkpoint {ckpt.round} weights differ from the ones published", ckpt.round
    return True, "", ckpt.round


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=36)
    ap.add_argument(
        "--max-wait",
        type=float,
        default=3.0,
        help="kill up to this long after the node serves (half that after spawn for start-up kills)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kill9.json")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the state dirs and logs here")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="coterie-kill9-"))
    workdir.mkdir(parents=True, exist_ok=True)
    state = workdir / "killed"
    shutil.rmtree(state, ignore_errors=True)
    learner = build_learner(LearnerConfig(**{**LEARNER, "init_seed": args.seed, "data_seed": args.seed}))
    t0 = time.monotonic()
    trials = []
    for k in range(args.kills):
        # a quarter of the kills land during start-up (restore, round-0 commit, binding ports),
        # the rest at a random moment once the node serves (mid-round, mid-commit)
        phase = "start-up" if rng.random() < 0.25 else "running"
        wait = rng.uniform(0.0, args.max_wait)
        p = spawn(workdir, node_config(state, None, args.seed), f"trial{k:03d}")
        durable, t_spawn = 0, time.monotonic()
        if phase == "running":  # once it serves and has checkpointed a round of its own
            resumed_at = trials[-1]["checkpoint_round"] if trials else 0
            while (
                p.poll() is None
                and time.monotonic() - t_spawn < 300
                and int((admin_status(state, p.pid) or {}).get("round", -1)) <= max(resumed_at, 0)
            ):
                time.sleep(0.02)
        deadline = time.monotonic() + (wait / 2 if phase == "start-up" else wait)
        while time.monotonic() < deadline and p.poll() is None:
            st = admin_status(state, p.pid) if phase == "running" else None
            if st:
                durable = max(durable, int(st["round"]))
            time.sleep(0.02)
        wait = time.monotonic() - t_spawn
        exited = p.poll()
        p.send_signal(signal.SIGKILL)
        p.wait()
        ok, why, ckpt_round = check_after_kill(state, durable, learner)
        if exited is not None:
            ok, why = False, f"exited by itself with {exited} before the kill; see trial{k:03d}.log"
        trials.append(
            {
                "trial": k,
                "phase": phase,
                "kill_after_s": round(wait, 3),
                "durable_seen": durable,
                "checkpoint_round": ckpt_round,
                "ok": ok,
                "problem": why if not ok else "",
            }
        )
        print(
            f"kill {k + 1:3d}/{args.kills} {phase:8s} {wait:5.2f}s after spawn: /status showed round {durable:4d}, "
            f"checkpoint {ckpt_round:3d}: {'ok' if ok else 'FAILED ' + why}",
            flush=True,
        )

    # past the last kill, then the uninterrupted reference over the same rounds
    last = max([t["checkpoint_round"] for t in trials] + [0]) + 3
    run_to_completion(workdir, state, last, args.seed, "final", 300)
    run_to_completion(workdir, workdir / "reference", last, args.seed, "reference", 300)
    got = [h["snapshot_sha256"] for h in history_rounds(state)]
    ref = [h["snapshot_sha256"] for h in history_rounds(workdir / "reference")]
    first_diff = next((i + 1 for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)
    exact = got == ref and len(ref) == last
    survivors = sum(t["ok"] for t in trials)
    result = {
        "kills": args.kills,
        "survivors": survivors,
        "exact_continuation": exact,
        "rounds_compared": len(ref),
        "first_differing_round": first_diff,
        "wall_s": round(time.monotonic() - t0, 1),
        "trials": trials,
        "config": {
            "seed": args.seed,
            "max_wait_s": args.max_wait,
            "node": node_config(Path("<state>"), None, args.seed),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        f"\n{survivors} of {args.kills} kills resumed exactly at their last checkpoint; "
        f"{len(ref)} rounds across {args.kills + 1} processes "
        f"{'bit-identical to' if exact else 'DIFFER from'} the uninterrupted run"
        f"{'' if exact else f' (first at round {first_diff})'}  -> {args.out}"
    )
    if args.workdir is None and survivors == args.kills and exact:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if survivors == args.kills and exact else 1


if __name__ == "__main__":
    sys.exit(main())
