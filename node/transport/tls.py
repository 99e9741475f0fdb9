"""mTLS for the peer port: gRPC credentials from a node's certificate (``security/pki.py``), and
the caller identity a server reads from the handshake.

Both ends present a certificate issued by the network CA and verify the other's against it. The
server reads the caller's node id from its certificate (URI SAN ``coterie:node:<id>``); the
client names the node it expects by its certificate DNS name (``ssl_target_name_override``), so
TLS itself refuses anyone else at that address — loopback, container or k8s service address
alike, since no address is ever in a certificate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ..config import ConfigError, NodeConfig
from ..security.pki import GENERIC_NAME, URI_PREFIX, NodeCredentials, PKIError, load_credentials, node_dns_name
from ..security.revocation import Revocation, revocation_for

RELOAD_CRL_S = 1.0  # how often the configured CRL file is looked at for a newer list


@dataclass(frozen=True)
class TLS:
    creds: NodeCredentials
    allow_ids: frozenset[str] | None = None  # None: any node the CA issued a certificate for
    revocation: Revocation | None = None  # the CA's revocation list, checked on every caller
    crl_path: Path | None = None  # the operator's CRL file, reloaded when it changes
    _watch: dict = field(default_factory=lambda: {"at": 0.0, "mtime": None}, compare=False, repr=False)

    def refusal(self, context: grpc.aio.ServicerContext) -> str | None:
        """Why the caller's TLS-verified certificate is refused although the CA signed it:
        revoked (the CA's CRL), expired or not yet valid. gRPC's TLS layer in Python takes no
        CRL, so this runs where the server reads the caller's identity; None: accepted."""
        if self.revocation is None:
            return None
        self._reload()
        pem = (context.auth_context() or {}).get("x509_pem_cert") or [b""]
        return self.revocation.problem(pem[0])

    def _reload(self) -> None:
        """Pick up a newer CRL the operator put in place (at most once a second, one stat)."""
        now = time.monotonic()
        if self.revocation is None or self.crl_path is None or now - self._watch["at"] < RELOAD_CRL_S:
            return
        self._watch["at"] = now
        try:
            mtime = self.crl_path.stat().st_mtime_ns
        except OSError:
            return
        if mtime != self._watch["mtime"]:
            self._watch["mtime"] = mtime
            try:
                self.revocation.load(self.crl_path)
            except (PKIError, OSError) as e:  # a bad file never replaces the list held
                import logging

                logging.getLogger("coterie.security").warning("%s not taken: %s", self.crl_path, e)

    @property
    def node_id(self) -> str:
        return self.creds.node_id

    def allowed(self, node_id: str) -> bool:
        return self.allow_ids is None or node_id in self.allow_ids

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.creds.key_pem, self.creds.cert_pem)], root_certificates=self.creds.ca_pem, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.creds.ca_pem, self.creds.key_pem, self.creds.cert_pem)

    @staticmethod
    def target_name(expected: str | None) -> str:
        """The certificate name a client asks for: the expected node's, or (first contact with an
        address) the one every node certificate carries."""
        return node_dns_name(expected) if expected else GENERIC_NAME


def caller_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The node id in the caller's verified certificate; None when the call is not over TLS with
    exactly one Coterie node id."""
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    ids = [
        u[len(URI_PREFIX) :]
        for u in (v.decode(errors="replace") for v in auth.get("peer_uri", []))
        if u.startswith(URI_PREFIX)
    ]
    return ids[0] if len(ids) == 1 else None


def load_tls(cfg: NodeConfig) -> TLS | None:
    """The node's mTLS identity, or None with ``security.insecure``. Fails closed: no
    certificates and no explicit ``insecure`` is a configuration error."""
    sec = cfg.security
    if sec.insecure:
        return None
    if not (sec.cert_dir or sec.cert):
        raise ConfigError(
            "no peer certificates configured: set security.cert_dir to a directory from "
            "`coterie cert issue` (see `coterie ca init`), or security.insecure = true "
            "for a plaintext peer port on a network you trust"
        )
    try:
        creds = load_credentials(sec.cert_dir, ca=sec.ca, cert=sec.cert, key=sec.key)
    except PKIError as e:
        raise ConfigError(f"security: {e}") from None
    if cfg.node_id is not None and cfg.node_id != creds.node_id:
        raise ConfigError(f"security: the certificate is for node {creds.node_id!r}, but node_id is {cfg.node_id!r}")
    crl = sec.crl or (Path(sec.cert_dir) / "crl.pem" if sec.cert_dir is not None else None)
    try:
        revocation = revocation_for(
            creds.ca_pem, crl=sec.crl, cert_dir=sec.cert_dir, state_dir=Path(cfg.state_dir) if cfg.state_dir else None
        )
    except (PKIError, OSError) as e:
        raise ConfigError(f"security: {e}") from None
    own = revocation.problem(creds.cert_pem)
    if own:
        raise ConfigError(f"security: this node's certificate is refused: {own}; its peers refuse it too")
    return TLS(
        creds, frozenset(sec.allow_ids) if sec.allow_ids is not None else None, revocation=revocation, crl_path=crl
    )
