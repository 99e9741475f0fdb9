"""The security pieces on their own (no daemons): certificates, the per-peer admission budget,
the log filter, the tensor decoder on forged tables, the config's fail-closed rules."""

from __future__ import annotations

import logging
import math
import struct

import msgpack
import pytest
import torch
from typer.testing import CliRunner

from coterie.cli.main import app
from coterie.node.config import ConfigError, load_config
from coterie.node.logfilter import BoundedRepeats
from coterie.node.peering.admission import Admission
from coterie.node.peering.errors import EXHAUSTED, Refusal
from coterie.node.security.ids import node_id_problem
from coterie.node.security.pki import (
    GENERIC_NAME,
    PKIError,
    cert_node_id,
    init_ca,
    issue_cert,
    load_credentials,
    node_dns_name,
)
from coterie.node.transport.tls import load_tls
from coterie.node.wire.codec import MAGIC, WireError, decode, encode


# ------------------------------------------------------------------------------ certificates
def test_ca_and_node_certificate_round_trip(tmp_path):
    init_ca(tmp_path / "ca")
    out = issue_cert(tmp_path / "ca", "n-0.example:7", tmp_path / "n0")
    creds = load_credentials(out)
    assert creds.node_id == "n-0.example:7" == cert_node_id(creds.cert_pem)
    assert (out / "node.key").stat().st_mode & 0o077 == 0  # the private key is the owner's only
    from cryptography import x509

    san = (
        x509.load_pem_x509_certificate(creds.cert_pem)
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert set(san.get_values_for_type(x509.DNSName)) == {GENERIC_NAME, node_dns_name("n-0.example:7")}


def test_a_long_node_id_still_fits_a_certificate(tmp_path):
    init_ca(tmp_path / "ca")
    long_id = "n" * 128  # over X.509's 64-character CN: the id lives in the URI SAN
    assert load_credentials(issue_cert(tmp_path / "ca", long_id, tmp_path / "n")).node_id == long_id


def test_node_dns_names_are_readable_for_dns_labels_and_never_collide():
    # a pod name is a DNS label: a certificate template (cert-manager csi-driver) can write its name
    assert node_dns_name("coterie-0") == "coterie-0.node.coterie"
    for other in ("Coterie-0", "n-0.example:7", "n" * 64, "-x"):  # not a lowercase DNS label: hashed
        name = node_dns_name(other)
        assert name.endswith(".node.coterie") and len(name.split(".")[0]) == 32
    # a node named like another's hash gets a hash of its own, not the other's name
    victim = node_dns_name("n-0.example:7")
    assert node_dns_name(victim.split(".")[0]) != victim


def test_another_nodes_key_is_refused_at_load(tmp_path):
    init_ca(tmp_path / "ca")
    a = issue_cert(tmp_path / "ca", "a", tmp_path / "a")
    b = issue_cert(tmp_path / "ca", "b", tmp_path / "b")
    with pytest.raises(PKIError, match="not the private key of the certificate"):
        load_credentials(a, key=b / "node.key")


def test_certificate_problems_are_named(tmp_path):
    init_ca(tmp_path / "ca")
    with pytest.raises(PKIError, match="refusing to replace"):
        init_ca(tmp_path / "ca")
    with pytest.raises(PKIError, match="characters outside"):
        issue_cert(tmp_path / "ca", "bad id", tmp_path / "x")
    with pytest.raises(PKIError, match="limit is 128"):
        issue_cert(tmp_path / "ca", "n" * 129, tmp_path / "x")
    out = issue_cert(tmp_path / "ca", "n1", tmp_path / "n1")
    init_ca(tmp_path / "other")
    (out / "ca.pem").write_bytes((tmp_path / "other" / "ca.pem").read_bytes())
    with pytest.raises(PKIError, match="not issued by the CA"):
        load_credentials(out)
    with pytest.raises(PKIError, match="does not exist"):
        load_credentials(tmp_path / "nowhere")


def test_cli_ca_and_cert_commands(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["ca", "init", str(tmp_path / "ca")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app, ["cert", "issue", "--ca", str(tmp_path / "ca"), "--node-id", "n7", "--out", str(tmp_path / "n7")]
    )
    assert r.exit_code == 0 and "--cert-dir" in r.output, r.output
    r = runner.invoke(app, ["cert", "show", str(tmp_path / "n7")])
    assert r.exit_code == 0 and "n7" in r.output
    r = runner.invoke(app, ["ca", "init", str(tmp_path / "ca")])
    assert r.exit_code == 1 and "refusing to replace" in r.output


def test_config_fails_closed(tmp_path):
    with pytest.raises(ConfigError, match="security.insecure"):
        load_tls(load_config(environ={}))
    assert load_tls(load_config(overrides={"security": {"insecure": True}}, environ={})) is None
    with pytest.raises(ConfigError, match="choose one"):
        load_config(overrides={"security": {"insecure": True, "cert_dir": str(tmp_path)}}, environ={})
    init_ca(tmp_path / "ca")
    issue_cert(tmp_path / "ca", "n1", tmp_path / "n1")
    with pytest.raises(ConfigError, match="certificate is for node 'n1'"):
        load_tls(load_config(overrides={"node_id": "n2", "security": {"cert_dir": str(tmp_path / "n1")}}, environ={}))
    assert load_tls(load_config(overrides={"security": {"cert_dir": str(tmp_path / "n1")}}, environ={})).node_id == "n1"
    with pytest.raises(ConfigError, match="node_id"):
        load_config(overrides={"node_id": "x" * 200}, environ={})


def test_node_ids_are_bounded():
    assert node_id_problem("node-1a2b") is None
    assert "empty" in node_id_problem("")
    assert "limit is 128" in node_id_problem("x" * 1_000_000)
    assert "outside" in node_id_problem("n0\n")


# ------------------------------------------------------------------------------ admission
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Limits:
    requests_per_s, request_burst = 10.0, 5.0
    compute_share, compute_burst_s = 0.25, 1.0
    max_concurrent = 2


def _refusal(adm, peer, kind) -> Refusal:
    with pytest.raises(Refusal) as err:
        with adm.admit(peer, kind):
            pass
    assert err.value.kind == EXHAUSTED
    return err.value


def test_admission_rate_bucket_refills():
    clock = Clock()
    adm = Admission(Limits(), clock=clock)
    for _ in range(5):
        with adm.admit("a", "snapshot"):
            pass
    assert "requests per second" in _refusal(adm, "a", "snapshot").message
    with adm.admit("b", "snapshot"):  # budgets are per peer
        pass
    clock.t += 0.1  # one token back at 10/s
    with adm.admit("a", "snapshot"):
        pass


def test_admission_concurrency_cap():
    adm = Admission(Limits(), clock=Clock())
    with adm.admit("a", "cross_loss"), adm.admit("a", "cross_loss"):
        assert "in flight" in _refusal(adm, "a", "cross_loss").message
    with adm.admit("a", "cross_loss"):  # slots come back when calls end, refused or not
        pass


def test_admission_compute_budget_is_billed_after_the_fact():
    clock = Clock()
    adm = Admission(Limits(), clock=clock)
    with adm.admit("a", "cross_gradient"):
        pass
    adm.charge("a", 3.0)  # one expensive call: 1 s burst - 3 s = 2 s of debt
    assert "compute budget" in _refusal(adm, "a", "cross_gradient").message
    with adm.admit("a", "snapshot"):  # compute debt does not block bulk reads
        pass
    clock.t += 7.0  # 0.25 s/s: the debt is paid after 8 s, not 7
    _refusal(adm, "a", "push_gradient")
    clock.t += 1.1
    with adm.admit("a", "push_gradient"):
        pass
    assert adm.view()["a"]["compute_s"] == 3.0


def test_served_compute_is_billed_its_cpu_time_not_its_wall_time():
    """Issue 22: compute was billed by wall time, so on a loaded node a request that waited (for
    the CPU, a lock, a warm-up) was billed everyone else's work and locked its peer out for ~36 s.
    A request that only waits must cost its peer (almost) nothing; one that computes, what it ran."""
    import asyncio
    import time
    from concurrent.futures import ThreadPoolExecutor

    from coterie.node.peering.served import ServedRequests

    served = ServedRequests.__new__(ServedRequests)  # just its executor and its bill
    served._pool = ThreadPoolExecutor(1)
    served.admission = Admission(Limits())

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    async def go():
        await served._run("waiter", time.sleep, 0.5)  # waits half a second, computes nothing
        await served._run("worker", spin, 0.2)
        await asyncio.sleep(0)  # the bill is posted back to the loop

    try:
        asyncio.run(go())
    finally:
        served._pool.shutdown()
    assert served.admission.view()["waiter"]["compute_s"] < 0.05
    assert 0.15 <= served.admission.view()["worker"]["compute_s"] < 0.5


# ------------------------------------------------------------------------------ log filter
def _record(msg: str, line: int = 1, level=logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("coterie", level, "x.py", line, msg, None, None)


def test_log_filter_cuts_long_lines_and_rate_limits_repeats():
    clock = Clock()
    f = BoundedRepeats(max_line=100, burst=3, site_burst=10, window_s=60, clock=clock)
    r = _record("peer said " + "A" * 10_000)
    assert f.filter(r) and len(r.getMessage()) < 130
    f = BoundedRepeats(burst=3, site_burst=10, window_s=60, clock=clock)
    passed = [f.filter(_record(f"refused cross_loss from n{i % 2}: bad {i}")) for i in range(20)]
    assert passed[:3] == [True] * 3 and not any(passed[3:])  # same text, digits aside
    clock.t += 61
    r = _record("refused cross_loss from n0: bad 99")
    assert f.filter(r) and "17 similar lines dropped" in r.getMessage()
    distinct = [f.filter(_record(f"garbage {chr(65 + i % 26) * (i + 1)}", line=2)) for i in range(30)]
    assert sum(distinct) == 10  # per call site, whatever the text
    assert f.filter(_record("info is never dropped", line=2, level=logging.INFO))
    dump = _record("asyncio tasks:\n" + "  frame\n" * 1000, line=3)
    dump.whole = True  # the node's own stack dumps (node/stacks.py): never cut, never dropped
    assert all(f.filter(dump) for _ in range(20)) and len(dump.getMessage()) > 7000


# ------------------------------------------------------------------------------ decoder
def _forged(groups: object, body: bytes = b"") -> bytes:
    raw = msgpack.packb({"meta": {}, "groups": groups}, use_bin_type=True)
    return MAGIC + struct.pack("<I", len(raw)) + raw + body


@pytest.mark.parametrize(
    "entry, needle",
    [
        (["w", "float32", [True, 2]], "not a list of sizes"),
        (["w", "float32", [-1]], "not a list of sizes"),
        (["w", "float32", [1] * 65], "dimensions"),
        (["w", "float32", [2**32, 2**32, 2**32]], "needs"),  # overflows int64 in np.prod
        (["w", "float32", [2**64 - 1]], "not a list of sizes"),
        (["w", "complex64", [1]], "unknown dtype"),
        (["w", "float32", [0, 2**62]], "not a list of sizes"),  # zero elements, but no such size
        (["w", "float32", [0, 7]], "trailing"),  # zero elements is fine, and 4 bytes are left over
        ("w", "malformed tensor entry"),
    ],
)
def test_decoder_refuses_forged_tables(entry, needle):
    with pytest.raises(WireError, match=needle):
        decode(_forged({"params": [entry]}, b"\x00" * 4))


def test_decoder_bool_bytes_must_be_bools():
    ok, _ = decode(encode({"g": {"m": torch.tensor([True, False])}}))
    assert ok["g"]["m"].tolist() == [True, False]
    with pytest.raises(WireError, match="bool bytes"):
        decode(_forged({"g": [["m", "bool", [2]]]}, b"\x01\x07"))


def test_decoder_caps_tensor_count():
    with pytest.raises(WireError, match="more than"):
        decode(_forged({"g": [[f"t{i}", "uint8", [0]] for i in range(70_000)]}))


def test_decoder_refusals_are_short():
    with pytest.raises(WireError) as err:
        decode(_forged({"params": [["w" * 100_000, "nope", [1]]]}))
    assert len(str(err.value)) < 400
    assert math.isfinite(len(str(err.value)))
