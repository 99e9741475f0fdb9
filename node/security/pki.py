"""A network's certificate authority and its node certificates (``cryptography``).

    coterie ca init DIR                        -> DIR/ca.pem, DIR/ca.key (0600)
    coterie cert issue --ca DIR --node-id ID --out OUT
                                               -> OUT/node.pem, OUT/node.key (0600), OUT/ca.pem

A node certificate carries the node id in a URI SAN ``coterie:node:<id>`` (what a server reads
from the TLS handshake to know who calls; the subject CN repeats it for people, cut to X.509's 64
characters) and two DNS SANs: ``coterie-peer`` (shared by every node, used only for the first
contact with an address whose owner is not known yet) and ``node_dns_name(id)`` (what a client
asks for when it dials a known peer, so that TLS itself checks it reached that node and no other). Addresses are never in a certificate: the same cert
works on loopback, in containers and behind k8s services, whatever the peer is dialled as.

Any CA that writes these SANs can issue node certificates, not only ``coterie cert issue``: on
Kubernetes, cert-manager's csi-driver does it per pod from volume attributes (deploy/k8s). That is
why ``node_dns_name`` of an id that is a DNS label (a pod name) is the readable ``<id>.node.coterie``
— a template can write it — and only other ids use a hash."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .ids import node_id_problem

CA_CERT, CA_KEY = "ca.pem", "ca.key"
NODE_CERT, NODE_KEY = "node.pem", "node.key"
ISSUED_FILE = "issued.jsonl"  # in the CA dir: the serials `cert issue` handed out, per node id
GENERIC_NAME = "coterie-peer"  # in every node certificate; first contact only
URI_PREFIX = "coterie:node:"  # the URI SAN that carries the node id (what peers read)


class PKIError(ValueError):
    """A CA or certificate that cannot be created, read or used, with the file named."""


def check_node_id(node_id: str) -> str:
    problem = node_id_problem(node_id)
    if problem:
        raise PKIError(problem)
    return node_id


_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_HASH_LABEL = re.compile(r"[0-9a-f]{32}")


def node_dns_name(node_id: str) -> str:
    """The DNS SAN that names one node: ``<id>.node.coterie`` when the id is a lowercase DNS label
    (a Kubernetes pod name: a certificate template can write it), else a hash of the id, which
    always is one. An id that looks like a hash (32 hex digits) is hashed too, so a node named
    like another's hash can never match that other's name."""
    if _DNS_LABEL.fullmatch(node_id) and not _HASH_LABEL.fullmatch(node_id):
        return f"{node_id}.node.coterie"
    return f"{hashlib.sha256(node_id.encode()).hexdigest()[:32]}.node.coterie"


def _write(path: Path, data: bytes, private: bool = False) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PKIError(f"{path} does not exist") from None
    except OSError as e:
        raise PKIError(f"cannot read {path}: {e}") from None


def init_ca(directory: str | Path, name: str = "coterie network CA", days: int = 3650, force: bool = False) -> Path:
    """Create a CA (EC P-256 key, self-signed) in ``directory``; refuses to overwrite one."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / CA_KEY).exists() and not force:
        raise PKIError(f"{d / CA_KEY} exists already; refusing to replace a CA (its certificates would stop verifying)")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(d / CA_KEY, _key_pem(key), private=True)
    _write(d / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    return d


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_pem, key_pem = _read(ca_dir / CA_CERT), _read(ca_dir / CA_KEY)
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as e:
        raise PKIError(f"CA in {ca_dir} is unreadable: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):  # init_ca writes EC keys only
        raise PKIError(f"CA key in {ca_dir}/{CA_KEY} is not an EC private key ({type(key).__name__})")
    return cert, key


def issue_cert(ca_dir: str | Path, node_id: str, out_dir: str | Path, days: int = 825) -> Path:
    """A certificate for ``node_id`` signed by the CA in ``ca_dir``, written with its key and
    the CA certificate to ``out_dir`` (everything a node needs: ``security.cert_dir``)."""
    check_node_id(node_id)
    ca_cert, ca_key = _load_ca(Path(ca_dir))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    san = x509.SubjectAlternativeName(
        [
            x509.DNSName(GENERIC_NAME),
            x509.DNSName(node_dns_name(node_id)),
            x509.UniformResourceIdentifier(URI_PREFIX + node_id),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id[:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(san, critical=False)
        # both ends of a peer connection: a node serves and calls
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write(out / NODE_KEY, _key_pem(key), private=True)
    _write(out / NODE_CERT, cert.public_bytes(serialization.Encoding.PEM))
    record_issued(ca_dir, node_id, cert)  # so that `cert revoke --node-id` finds its serial
    _write(out / CA_CERT, ca_cert.public_bytes(serialization.Encoding.PEM))
    return out


def record_issued(ca_dir: str | Path, node_id: str, cert: x509.Certificate) -> None:
    """Note a certificate ``cert issue`` handed out (so ``revoke --node-id`` finds its serial)."""
    with open(Path(ca_dir) / ISSUED_FILE, "a") as f:
        f.write(
            json.dumps(
                {
                    "node_id": node_id,
                    "serial": format(cert.serial_number, "x"),
                    "not_after": cert.not_valid_after_utc.isoformat(),
                }
            )
            + "\n"
        )


def certificate_problem(cert: x509.Certificate, now: dt.datetime | None = None) -> str | None:
    """Why a certificate is not valid now (expired, not yet valid), or None."""
    now = now or dt.datetime.now(dt.timezone.utc)
    if now > cert.not_valid_after_utc:
        return f"its certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if now < cert.not_valid_before_utc:
        return f"its certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
    return None


@dataclass(frozen=True)
class NodeCredentials:
    """A node's TLS material as PEM bytes, and the node id its certificate names."""

    node_id: str
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def cert_node_id(cert_pem: bytes, where: str = "certificate") -> str:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise PKIError(f"{where} is not a PEM certificate: {e}") from None
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise PKIError(f"{where} has no subject alternative names: not a Coterie node certificate") from None
    ids = [
        u[len(URI_PREFIX) :]
        for u in san.get_values_for_type(x509.UniformResourceIdentifier)
        if u.startswith(URI_PREFIX)
    ]
    if len(ids) != 1:
        raise PKIError(f"{where} names {len(ids)} node ids; a node certificate names exactly one")
    return check_node_id(ids[0])


def load_credentials(
    cert_dir: str | Path | None = None,
    *,
    ca: str | Path | None = None,
    cert: str | Path | None = None,
    key: str | Path | None = None,
) -> NodeCredentials:
    """A node's credentials from a ``coterie cert issue`` directory, or from explicit paths (which
    win over the directory's files)."""
    d = Path(cert_dir) if cert_dir is not None else None

    def pick(explicit, name: str) -> Path:
        if explicit is not None:
            return Path(explicit)
        if d is None:
            raise PKIError(f"no {name} given (set security.cert_dir or the file itself)")
        return d / name

    ca_p, cert_p, key_p = pick(ca, CA_CERT), pick(cert, NODE_CERT), pick(key, NODE_KEY)
    ca_pem, cert_pem, key_pem = _read(ca_p), _read(cert_p), _read(key_p)
    node_id = cert_node_id(cert_pem, str(cert_p))
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_pem)
        x509.load_pem_x509_certificate(cert_pem).verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature) as e:
        raise PKIError(f"{cert_p} is not issued by the CA in {ca_p}: {type(e).__name__} {e}") from None
    try:
        private = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise PKIError(f"{key_p} is not an unencrypted PEM private key: {e}") from None
    # another node's key (a mixed-up mount) would only fail at the first handshake: fail here
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if private.public_key().public_bytes(*spki) != x509.load_pem_x509_certificate(cert_pem).public_key().public_bytes(
        *spki
    ):
        raise PKIError(f"{key_p} is not the private key of the certificate {cert_p} (node {node_id!r})")
    why = certificate_problem(x509.load_pem_x509_certificate(cert_pem))
    if why:  # peers refuse it anyway: say so at start, not as refusals later
        raise PKIError(f"{cert_p}: {why}; issue a new one (coterie cert issue)")
    return NodeCredentials(node_id, ca_pem, cert_pem, key_pem)
