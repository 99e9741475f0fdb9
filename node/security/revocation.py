"""Revoking a node certificate: a certificate revocation list (CRL) signed by the network CA.

A certificate proves a node id until it expires; a compromised device keeps a valid one. The CA
revokes it (``coterie cert revoke --ca DIR --node-id ID``, or ``--serial``): the CA directory
keeps ``crl.pem``, an X.509 CRL (cryptography's builder) with a CRL number that grows with each
revocation, and ``issued.jsonl``, the serials ``cert issue`` handed out per node id (how a node id
maps to serials). The revoked node ids also travel in the CRL (a private non-critical extension,
under the CA's signature), so a node can drop a revoked member it never saw the certificate of.

Nodes load the CRL from ``security.crl`` (or ``crl.pem`` in their cert dir). A CRL is
self-authenticating: whoever hands it over, a node takes it only if the CA's signature verifies,
and only if its number is newer than the one it holds (``Revocation.offer``) — so it may come
from an operator's file or from any peer. gRPC's TLS layer in Python takes no CRL, so the check
is at the application level, where the server reads the caller's verified certificate
(``Revocation.problem``: revoked, expired or not yet valid), on every request that names its
caller — a revoked node is refused on its next handshake or call.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPublicKeyTypes
from cryptography.x509.oid import ObjectIdentifier

from .pki import (
    CA_CERT,
    ISSUED_FILE,
    PKIError,
    _load_ca,
    cert_node_id,
    certificate_problem,
    check_node_id,
    record_issued,
)

log = logging.getLogger("coterie.security")

CRL_FILE = "crl.pem"
# revoked node ids, JSON, inside the signed CRL (a private arc: non-critical, others ignore it)
REVOKED_IDS_OID = ObjectIdentifier("1.3.6.1.4.1.59999.22.1")
MAX_CRL_BYTES = 4 << 20


def issued_serials(ca_dir: str | Path, node_id: str) -> list[int]:
    path = Path(ca_dir) / ISSUED_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if row["node_id"] == node_id:
                out.append(int(row["serial"], 16))
        except (ValueError, KeyError, TypeError):
            raise PKIError(f"{path} line {n} is corrupt") from None
    return out


@dataclass(frozen=True)
class RevocationList:
    """A CRL whose signature was checked against the network CA."""

    number: int
    serials: frozenset[int]
    node_ids: frozenset[str]
    pem: bytes
    next_update: dt.datetime | None

    @classmethod
    def parse(cls, data: bytes, ca_cert: x509.Certificate, where: str = "CRL") -> RevocationList:
        if len(data) > MAX_CRL_BYTES:
            raise PKIError(f"{where} is {len(data)} bytes, more than {MAX_CRL_BYTES}")
        try:
            crl = x509.load_pem_x509_crl(data) if data.lstrip().startswith(b"-----") else x509.load_der_x509_crl(data)
        except ValueError as e:
            raise PKIError(f"{where} is not a CRL: {e}") from None
        # a CA's key signs its certificates: never a key-exchange-only kind (X25519/X448)
        ca_key = cast(CertificateIssuerPublicKeyTypes, ca_cert.public_key())
        if crl.issuer != ca_cert.subject or not crl.is_signature_valid(ca_key):
            raise PKIError(f"{where} is not signed by this network's CA ({ca_cert.subject.rfc4514_string()})")
        try:
            number = int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
        except x509.ExtensionNotFound:
            number = 0
        ids: frozenset[str] = frozenset()
        try:
            # our own OID: cryptography parses it into no class of its own, only UnrecognizedExtension
            ext = cast(x509.UnrecognizedExtension, crl.extensions.get_extension_for_oid(REVOKED_IDS_OID).value)
            raw = ext.value
            ids = frozenset(check_node_id(str(i)) for i in json.loads(raw))
        except x509.ExtensionNotFound:
            pass
        except (ValueError, TypeError, PKIError) as e:
            raise PKIError(f"{where}: its revoked node ids are unreadable: {e}") from None
        return cls(
            number,
            frozenset(r.serial_number for r in crl),
            ids,
            crl.public_bytes(serialization.Encoding.PEM),
            crl.next_update_utc,
        )


def revoke(
    ca_dir: str | Path, *, node_id: str | None = None, serials: Sequence[int] = (), days: int = 30
) -> tuple[Path, RevocationList]:
    """Add ``node_id``'s certificates (from issued.jsonl) and ``serials`` to the CA's CRL, signed
    with a CRL number one higher; returns the file and what it now revokes."""
    ca_dir = Path(ca_dir)
    ca_cert, ca_key = _load_ca(ca_dir)
    path = ca_dir / CRL_FILE
    old = RevocationList.parse(path.read_bytes(), ca_cert, str(path)) if path.exists() else None
    add = set(serials)
    ids = set(old.node_ids) if old else set()
    if node_id is not None:
        check_node_id(node_id)
        found = issued_serials(ca_dir, node_id)
        if not found and not serials:
            raise PKIError(
                f"no certificate issued to {node_id!r} is recorded in {ca_dir / ISSUED_FILE}; "
                "revoke it by --serial (coterie cert show prints it)"
            )
        add.update(found)
        ids.add(node_id)
    if not add and node_id is None:
        raise PKIError("nothing to revoke: give --node-id or --serial")
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=days))
        .add_extension(x509.CRLNumber((old.number if old else 0) + 1), critical=False)
        .add_extension(x509.UnrecognizedExtension(REVOKED_IDS_OID, json.dumps(sorted(ids)).encode()), critical=False)
    )
    for serial in sorted((set(old.serials) if old else set()) | add):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    path.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    return path, RevocationList.parse(path.read_bytes(), ca_cert, str(path))


class Revocation:
    """What this node knows is revoked: the newest valid CRL it has seen (none at first)."""

    def __init__(self, ca_pem: bytes, store: Path | None = None):
        self.ca_cert = x509.load_pem_x509_certificate(ca_pem)
        self.store = store  # where a newer CRL from a peer is kept (survives a restart)
        self.current: RevocationList | None = None
        self.refused = 0
        self.listeners: list = []  # called with the revoked node ids whenever a newer list is taken
        self._lock = threading.Lock()

    def load(self, path: Path) -> bool:
        """Take the CRL in ``path`` if newer; a CRL that does not verify is an error naming it."""
        return self.offer(path.read_bytes(), where=str(path))

    def offer(self, data: bytes, where: str = "a peer's CRL") -> bool:
        """Take ``data`` if it is a CRL signed by the CA and newer than the current one. True if
        taken; False if not newer; PKIError if it does not verify."""
        crl = RevocationList.parse(data, self.ca_cert, where)
        with self._lock:
            if self.current is not None and crl.number <= self.current.number:
                return False
            self.current = crl
        log.info(
            "revocation list %d from %s: %d certificates, node ids %s revoked",
            crl.number,
            where,
            len(crl.serials),
            sorted(crl.node_ids) or "none",
        )
        for listener in list(self.listeners):
            listener(crl.node_ids)
        if self.store is not None:
            try:
                self.store.write_bytes(crl.pem)
            except OSError as e:
                log.warning("could not keep the revocation list in %s: %s", self.store, e)
        return True

    @property
    def revoked_ids(self) -> frozenset[str]:  # noqa: D401
        cur = self.current
        return cur.node_ids if cur else frozenset()

    def problem(self, cert_pem: bytes) -> str | None:
        """Why a peer's (TLS-verified) certificate must be refused now, or None."""
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
        except ValueError:
            return "its certificate could not be read"
        cur = self.current
        why = None
        if cur is not None and cert.serial_number in cur.serials:
            why = f"its certificate (serial {cert.serial_number:x}) is revoked by CRL {cur.number}"
        else:
            why = certificate_problem(cert)
        if why:
            self.refused += 1
        return why


def revocation_for(ca_pem: bytes, *, crl: Path | None, cert_dir: Path | None, state_dir: Path | None) -> Revocation:
    """The node's revocation state at start: the configured CRL (``security.crl``, else
    ``crl.pem`` in the cert dir) and the newest one kept from peers, whichever is newer."""
    rev = Revocation(ca_pem, store=state_dir / CRL_FILE if state_dir is not None else None)
    for path in (
        crl,
        cert_dir / CRL_FILE if cert_dir is not None and crl is None else None,
        state_dir / CRL_FILE if state_dir is not None else None,
    ):
        if path is not None and path.exists():
            rev.load(path)
    return rev


__all__ = [
    "CA_CERT",
    "CRL_FILE",
    "Revocation",
    "RevocationList",
    "certificate_problem",
    "cert_node_id",
    "record_issued",
    "revocation_for",
    "revoke",
]
