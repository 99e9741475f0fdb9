"""mTLS for the peer port: gRPC credentials from a node's certificate (``security/pki.py``), and
the caller identity a server reads from the handshake.

Both ends present a certificate issued by the network CA and verify the other's against it. The
server reads the caller's node id from its certificate (URI SAN ``coterie:node:<id>``); the
client names the node it expects by its certificate DNS name (``ssl_target_name_override``), so
TLS itself refuses anyone else at that address — loopback, container or k8s service address
alike, since no address is ever in a certificate."""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from ..config import ConfigError, NodeConfig
from ..security.pki import GENERIC_NAME, URI_PREFIX, NodeCredentials, PKIError, load_credentials, node_dns_name


@dataclass(frozen=True)
class TLS:
    creds: NodeCredentials
    allow_ids: frozenset[str] | None = None  # None: any node the CA issued a certificate for

    @property
    def node_id(self) -> str:
        return self.creds.node_id

    def allowed(self, node_id: str) -> bool:
        return self.allow_ids is None or node_id in self.allow_ids

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.creds.key_pem, self.creds.cert_pem)],
                                           root_certificates=self.creds.ca_pem, require_client_auth=True)

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
    ids = [u[len(URI_PREFIX):] for u in (v.decode(errors="replace") for v in auth.get("peer_uri", []))
           if u.startswith(URI_PREFIX)]
    return ids[0] if len(ids) == 1 else None


def load_tls(cfg: NodeConfig) -> TLS | None:
    """The node's mTLS identity, or None with ``security.insecure``. Fails closed: no
    certificates and no explicit ``insecure`` is a configuration error."""
    sec = cfg.security
    if sec.insecure:
        return None
    if not (sec.cert_dir or sec.cert):
        raise ConfigError("no peer certificates configured: set security.cert_dir to a directory from "
                          "`coterie cert issue` (see `coterie ca init`), or security.insecure = true "
                          "for a plaintext peer port on a network you trust")
    try:
        creds = load_credentials(sec.cert_dir, ca=sec.ca, cert=sec.cert, key=sec.key)
    except PKIError as e:
        raise ConfigError(f"security: {e}") from None
    if cfg.node_id is not None and cfg.node_id != creds.node_id:
        raise ConfigError(f"security: the certificate is for node {creds.node_id!r}, but node_id is "
                          f"{cfg.node_id!r}")
    return TLS(creds, frozenset(sec.allow_ids) if sec.allow_ids is not None else None)
