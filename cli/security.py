"""``coterie ca`` and ``coterie cert``: the network CA and node certificates (mTLS on the peer port).

  coterie ca init DIR                                   a new CA: DIR/ca.pem, DIR/ca.key (0600)
  coterie cert issue --ca DIR --node-id ID --out OUT    OUT/node.pem, node.key, ca.pem for node ID
  coterie cert show OUT                                 whose certificate, issued by whom, until when
  coterie cert revoke --ca DIR --node-id ID             DIR/crl.pem: a CA-signed revocation list for the nodes

A node then runs with ``security.cert_dir = OUT`` (``--set security.cert_dir=OUT``). Keep ca.key
off the nodes: only ``cert issue`` needs it.
"""

from __future__ import annotations

from pathlib import Path

import typer

ca_app = typer.Typer(help="The network's certificate authority.", no_args_is_help=True)
cert_app = typer.Typer(help="Node certificates (the node id lives in the certificate).", no_args_is_help=True)


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(1)


@ca_app.command("init")
def ca_init(
    directory: Path = typer.Argument(..., help="where ca.pem and ca.key go"),
    name: str = typer.Option("coterie network CA", "--name", help="the CA's subject name"),
    days: int = typer.Option(3650, "--days", min=1),
    force: bool = typer.Option(False, "--force", help="replace an existing CA (its certificates stop verifying)"),
) -> None:
    """Create a CA (EC P-256)."""
    from coterie.node.security.pki import CA_CERT, CA_KEY, PKIError, init_ca

    try:
        d = init_ca(directory, name=name, days=days, force=force)
    except (PKIError, OSError) as e:
        raise _fail(str(e)) from e
    typer.echo(f"CA written: {d / CA_CERT} (certificate), {d / CA_KEY} (private key, keep it off the nodes)")


@cert_app.command("issue")
def cert_issue(
    ca: Path = typer.Option(..., "--ca", help="CA directory (coterie ca init)"),
    node_id: str = typer.Option(..., "--node-id", help="the node id the certificate proves"),
    out: Path = typer.Option(..., "--out", help="directory for node.pem, node.key, ca.pem"),
    days: int = typer.Option(825, "--days", min=1),
) -> None:
    """Issue a node certificate signed by the CA."""
    from coterie.node.security.pki import PKIError, issue_cert

    try:
        d = issue_cert(ca, node_id, out, days=days)
    except (PKIError, OSError) as e:
        raise _fail(str(e)) from e
    typer.echo(f"certificate for node {node_id!r} written to {d} (run the node with --cert-dir {d})")


@cert_app.command("show")
def cert_show(directory: Path = typer.Argument(..., help="a node's certificate directory")) -> None:
    """The node id, issuer and validity of a node certificate (checked against its ca.pem)."""
    from cryptography import x509

    from coterie.node.security.pki import NODE_CERT, PKIError, load_credentials

    try:
        creds = load_credentials(directory)
    except PKIError as e:
        raise _fail(str(e)) from e
    cert = x509.load_pem_x509_certificate(creds.cert_pem)
    typer.echo(
        f"node id:  {creds.node_id}\nserial:   {cert.serial_number:x}\nissuer:   {cert.issuer.rfc4514_string()}\n"
        f"valid:    {cert.not_valid_before_utc:%Y-%m-%d} .. {cert.not_valid_after_utc:%Y-%m-%d}\n"
        f"file:     {Path(directory) / NODE_CERT} (issued by the CA in ca.pem: yes)"
    )


@cert_app.command("revoke")
def cert_revoke(
    ca: Path = typer.Option(..., "--ca", help="CA directory (coterie ca init)"),
    node_id: str = typer.Option(None, "--node-id", help="revoke every certificate issued to this node id"),
    serial: list[str] = typer.Option(None, "--serial", help="a certificate serial (hex), repeatable"),
    days: int = typer.Option(30, "--days", min=1, help="when nodes should expect a newer list"),
) -> None:
    """Revoke a node's certificate: CA_DIR/crl.pem, a revocation list signed by the CA. Give it to
    the nodes (security.crl, or crl.pem in their cert dir): they refuse the revoked node on its
    next call and drop it from membership."""
    from coterie.node.security.pki import PKIError
    from coterie.node.security.revocation import revoke

    try:
        serials = [int(s, 16) for s in serial or ()]
    except ValueError:
        raise _fail(f"--serial takes hexadecimal serials, got {serial}") from None
    try:
        path, crl = revoke(ca, node_id=node_id, serials=serials, days=days)
    except (PKIError, OSError) as e:
        raise _fail(str(e)) from e
    typer.echo(
        f"revocation list {crl.number} written to {path}: {len(crl.serials)} certificates revoked"
        f"{', node ids ' + ', '.join(sorted(crl.node_ids)) if crl.node_ids else ''}. Copy it to each "
        "node's cert dir as crl.pem (or security.crl); nodes pick up a newer one within a second"
    )
