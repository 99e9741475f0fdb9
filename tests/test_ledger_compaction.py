"""The privacy ledger stays bounded when peers ask for ever other batch sizes (each a distinct
(σ, q)): past ``MAX_STEPS`` an account folds its least used steps into their summed RDP. ε is the
same before and after (RDP composes by addition), the integrity checks of issue 22 still refuse a
ledger that records less than its checkpoint's pin, and kill -9 during a compaction resumes with
every release that left still counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from coterie.node.fsutil import atomic_write_json, read_json
from coterie.node.privacy import accountant
from coterie.node.privacy import ledger as ledger_module
from coterie.node.privacy.ledger import FORMAT_FOLDED, LedgerError, PrivacyLedger, _checksum

SIGMA, DELTA = 1.1, 1e-5
MAX_STEPS = 8  # the default (64) folds the same way, only later: RDP of a new q costs ~0.1-0.5 s


@pytest.fixture(autouse=True)
def small_accounts(monkeypatch):
    monkeypatch.setattr(ledger_module, "MAX_STEPS", MAX_STEPS)


def q_of(i: int) -> float:
    return (16 + i % 40) / 1000  # peers asking for batch 16, 17, ..., 55 of 1000 samples, again and again


def uncompacted(releases: list[int]) -> float:
    return accountant.epsilon([(SIGMA, q_of(i), 1) for i in releases], DELTA)


def charged(tmp_path, n: int) -> PrivacyLedger:
    ledger = PrivacyLedger(tmp_path, delta=DELTA)
    for i in range(n):
        ledger.charge(f"n{i % 2}", "fedfomo-loss", SIGMA, q_of(i), enforce=False)
    return ledger


def test_compaction_keeps_every_epsilon_and_bounds_the_file(tmp_path):
    sizes = []
    ledger = PrivacyLedger(tmp_path, delta=DELTA)
    for i in range(200):
        before = (ledger.epsilon(), ledger.epsilon("n0"), ledger.epsilon("n1"))
        folded = ledger.total.folded
        ledger.charge(f"n{i % 2}", "fedfomo-loss", SIGMA, q_of(i), enforce=False)
        if ledger.total.folded is not folded:  # this release compacted the total: ε moved by one release only
            assert ledger.epsilon() == pytest.approx(uncompacted(list(range(i + 1))), rel=1e-12)
            assert ledger.epsilon() > before[0]
        sizes.append(ledger.path.stat().st_size)
    assert all(len(a.steps) <= MAX_STEPS for a in [ledger.total, *ledger.peers.values()])
    assert ledger.total.folded is not None and ledger.total.folded_releases > 100
    assert max(sizes[100:]) < 1.1 * max(sizes[30:100]), "the file kept growing with distinct (σ, q)"
    assert ledger.epsilon() == pytest.approx(uncompacted(list(range(200))), rel=1e-12)
    assert ledger.epsilon("n0") == pytest.approx(uncompacted(list(range(0, 200, 2))), rel=1e-12)
    assert ledger.epsilon("n1") == pytest.approx(uncompacted(list(range(1, 200, 2))), rel=1e-12)
    again = PrivacyLedger(tmp_path, delta=DELTA)  # read back: the same figures (to the float sum's order)
    assert again.total.releases == 200 and again.total.folded_releases == ledger.total.folded_releases
    assert again.epsilon() == pytest.approx(ledger.epsilon(), rel=1e-14)
    assert again.epsilon("n0") == pytest.approx(ledger.epsilon("n0"), rel=1e-14)
    assert read_json(ledger.path)["format"] == FORMAT_FOLDED  # an older release refuses it, never under-counts
    # the budget still binds over a fold: the share and total checks see the folded releases
    capped = PrivacyLedger(tmp_path, delta=DELTA, budget=ledger.epsilon() * 1.0000001)
    with pytest.raises(Exception, match="budget spent"):
        capped.charge("n0", "fedfomo-loss", SIGMA, 0.5)


def _rewrite(path, edit):
    data = read_json(path)
    body = {k: v for k, v in data.items() if k != "sha256"}
    edit(body)
    atomic_write_json(path, {**body, "sha256": _checksum(body)})  # a valid checksum: only the pin can tell


def test_a_folded_ledger_that_records_less_than_its_pin_is_refused(tmp_path):
    ledger = charged(tmp_path, 100)
    pin = ledger.pin()
    PrivacyLedger(tmp_path, delta=DELTA).verify(pin, checkpoint="ckpt-000009.safetensors")  # as written: fine

    def lower_fold(body):
        body["total"]["folded"]["rdp"] = [x * 0.5 for x in body["total"]["folded"]["rdp"]]

    _rewrite(ledger.path, lower_fold)
    with pytest.raises(LedgerError, match="fewer than"):
        PrivacyLedger(tmp_path, delta=DELTA).verify(pin, checkpoint="ckpt-000009.safetensors")

    charged(tmp_path / "b", 100)

    def drop_fold(body):  # forget the folded releases: the counts alone would under-count
        body["total"].pop("folded")

    _rewrite(tmp_path / "b" / "privacy-ledger.json", drop_fold)
    with pytest.raises(LedgerError, match="corrupt"):
        PrivacyLedger(tmp_path / "b", delta=DELTA)
    # with --reset-privacy-ledger, the pin (with its fold) is restored and ε is back
    (tmp_path / "b" / "privacy-ledger.json").unlink()
    restored = PrivacyLedger(tmp_path / "b", delta=DELTA)
    restored.verify(pin, checkpoint="ckpt-000009.safetensors", reset=True)
    assert restored.epsilon() == pytest.approx(uncompacted(list(range(100))), rel=1e-12)


WRITER = textwrap.dedent("""
    import os, signal, sys
    from coterie.node.privacy import ledger as ledger_module
    from coterie.node.privacy.ledger import PrivacyLedger
    ledger_module.MAX_STEPS = 8
    state, crash, stop = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real = os.replace

    def folded(path):
        try:
            with open(path, "rb") as f:
                return b'"folded"' in f.read()
        except FileNotFoundError:
            return False

    def replace(src, dst):
        first_fold = crash != "none" and folded(src) and not folded(dst)
        if first_fold and crash == "before-rename":
            os.kill(os.getpid(), signal.SIGKILL)  # the compacted ledger written, fsynced, not renamed
        real(src, dst)
        if first_fold and crash == "after-rename":
            os.kill(os.getpid(), signal.SIGKILL)  # compacted and in place; charge() never returned

    os.replace = replace
    ledger = PrivacyLedger(state, delta=1e-5)
    for i in range(ledger.total.releases, stop):
        ledger.charge(f"n{i % 2}", "fedfomo-loss", 1.1, (16 + i % 40) / 1000, enforce=False)
        print(i + 1, flush=True)  # the release may leave now
""")


def _run(script, state, crash, stop):
    p = subprocess.run(
        [sys.executable, str(script), str(state), crash, str(stop)], capture_output=True, text=True, timeout=120
    )
    out = p.stdout.split()
    return p.returncode, int(out[-1]) if out else 0


@pytest.mark.parametrize("crash", ["before-rename", "after-rename"])
def test_kill9_during_a_compaction_resumes_exactly(tmp_path, crash):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    stop = 2 * MAX_STEPS + 40
    assert _run(script, tmp_path / "ref", "none", stop) == (0, stop)
    state = tmp_path / "state"
    rc, left = _run(script, state, crash, stop)
    assert rc == -9 and MAX_STEPS <= left < stop, (rc, left)
    assert not [p for p in os.listdir(state) if p.endswith(".tmp")] or crash == "before-rename"
    ledger = PrivacyLedger(state, delta=DELTA)
    # every release that left is counted; the one being charged at the kill may be too (over-count)
    counted = left + (1 if crash == "after-rename" else 0)
    assert ledger.total.releases == counted
    assert (ledger.total.folded is not None) == (crash == "after-rename")
    assert ledger.epsilon() == pytest.approx(uncompacted(list(range(counted))), rel=1e-12)
    assert _run(script, state, "none", stop) == (0, stop)
    a, b = (json.loads((d / "privacy-ledger.json").read_text()) for d in (state, tmp_path / "ref"))
    assert a == b  # resumed: the same ledger as a run never killed
