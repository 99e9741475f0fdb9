"""deploy/k8s: the StatefulSet, its headless Service, ConfigMap and cert-manager Issuer (base/)
and the GPU overlay (gpu/) are valid Kubernetes objects (kubernetes-validate, strict: unknown
fields fail too), they fit together, and every pod can start: its environment rendered, the files
its volumes provide created (its certificate as cert-manager's csi-driver writes it from the
volume attributes, signed by a CA from `coterie ca init`), its whole node configuration and TLS
credentials loaded as the daemon loads them, its node id the pod's name.

The overlay is rendered here as kustomize does (its resources + its JSON 6902 patches, with the
``jsonpatch`` library); where ``kubectl`` is installed its own ``kubectl kustomize`` must agree."""

from __future__ import annotations

import copy
import datetime as dt
import importlib.util
import json
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coterie.cli.main import preflight
from coterie.node.config import ConfigError, load_config, unknown_env
from coterie.node.security.pki import init_ca
from coterie.node.transport.grpc_transport import GrpcTransport
from coterie.node.transport.tls import TLS, load_tls

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
jsonpatch = pytest.importorskip("jsonpatch", reason="pip install -e '.[test]'")

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
VERSION = "1.32"  # the pod-index label the StatefulSet reads is GA from 1.32 (beta, on by default, from 1.28)


def render(directory: Path) -> list[dict]:
    """A kustomization's objects: its resources (files or other kustomizations) with its patches."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        objs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for p in k.get("patches", []):
        targets = [
            o
            for o in objs
            if all(o.get("kind") == v if f == "kind" else o["metadata"].get(f) == v for f, v in p["target"].items())
        ]
        assert targets, f"patch target {p['target']} matches nothing"
        ops = jsonpatch.JsonPatch(yaml.safe_load(p["patch"]))
        objs = [ops.apply(o) if o in targets else o for o in objs]
    return objs


def one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, (kind, [o["kind"] for o in objs])
    return found[0]


def pod_environment(objs: list[dict], index: int) -> dict[str, str]:
    """The environment pod ``index`` starts its entrypoint with: the ConfigMap (envFrom), then
    the container's env with the downward API filled in and $(VAR) expanded as the kubelet does,
    then the container command itself, run with ``env`` standing in for the entrypoint."""
    sts, cm = one(objs, "StatefulSet"), one(objs, "ConfigMap")
    pod = sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    name = f"{sts['metadata']['name']}-{index}"
    fields = {"metadata.name": name, "metadata.labels['apps.kubernetes.io/pod-index']": str(index)}
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        assert src["configMapRef"]["name"] == cm["metadata"]["name"]
        env.update(cm["data"])
    for e in container["env"]:
        if "valueFrom" in e:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"]
            )
    assert container["command"] == ["/bin/sh", "-c"]
    script = container["args"][0]
    assert "exec /src/deploy/entrypoint.sh" in script
    out = subprocess.run(
        ["/bin/sh", "-c", script.replace("exec /src/deploy/entrypoint.sh", "exec env -0")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


CORE_KINDS = ["ConfigMap", "Service", "StatefulSet"]


@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_every_object_is_valid_kubernetes(variant):
    objs = render(K8S / variant)
    assert sorted(o["kind"] for o in objs) == sorted(CORE_KINDS + ["Issuer"])
    for o in objs:
        if o["kind"] in CORE_KINDS:
            kubernetes_validate.validate(o, VERSION, strict=True)
    # cert-manager's CRD has no schema in kubernetes-validate: the fields a CA Issuer has, by hand
    issuer = one(objs, "Issuer")
    assert issuer["apiVersion"] == "cert-manager.io/v1"
    assert set(issuer) == {"apiVersion", "kind", "metadata", "spec"} and list(issuer["spec"]) == ["ca"]
    assert set(issuer["spec"]["ca"]) == {"secretName"}


def test_the_validator_would_catch_a_broken_manifest():
    sts = one(render(K8S / "base"), "StatefulSet")
    typo = copy.deepcopy(sts)
    typo["spec"]["template"]["spec"]["containers"][0]["resourses"] = {}  # unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSION, strict=True)
    wrong_type = copy.deepcopy(sts)
    wrong_type["spec"]["replicas"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, VERSION, strict=True)


def volumes_of(objs: list[dict]) -> dict[str, tuple[str, dict]]:
    """mount path -> (volume name, volume source) of the node container: pod volumes and claims."""
    sts = one(objs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    sources = {v["name"]: v for v in pod.get("volumes", [])}
    sources.update(
        {
            c["metadata"]["name"]: {"name": c["metadata"]["name"], "persistentVolumeClaim": c}
            for c in sts["spec"].get("volumeClaimTemplates", [])
        }
    )
    return {m["mountPath"]: (m["name"], sources[m["name"]]) for m in pod["containers"][0]["volumeMounts"]}


@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_the_pieces_fit_together(variant):
    objs = render(K8S / variant)
    sts, svc, cm = one(objs, "StatefulSet"), one(objs, "Service"), one(objs, "ConfigMap")
    spec, pod = sts["spec"], sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # the headless Service names the pods (coterie-0.coterie) and publishes them before they are ready
    assert spec["serviceName"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)

    # state and data on a volume claim per pod; every volume mounted; requests and limits; probes
    mounts = {name: path for path, (name, _) in volumes_of(objs).items()}
    claims = {c["metadata"]["name"] for c in spec["volumeClaimTemplates"]}
    assert claims == {"state", "data"} and set(mounts) == claims | {v["name"] for v in pod["spec"]["volumes"]}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) <= set(container["resources"]["limits"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "admin"}, probe
    assert pod["spec"]["automountServiceAccountToken"] is False  # a node needs no Kubernetes API token

    # what each pod runs with: a valid node config, its own stable identity, nothing misspelled
    replicas = spec["replicas"]
    seed_address = None
    for i in range(replicas):
        env = pod_environment(objs, i)
        assert unknown_env(env) == []
        cfg = load_config(environ=env)
        assert cfg.node_id == f"coterie-{i}"
        assert str(cfg.state_dir) == mounts["state"]
        # its own samples on its own volume, not shard i of a dataset; classes from the ConfigMap
        assert cfg.learner.data == mounts["data"] and "COTERIE_LEARNER__NODE_INDEX" not in env
        assert cfg.learner.classes == json.loads(cm["data"]["COTERIE_LEARNER__CLASSES"])
        assert str(cfg.security.cert_dir) == mounts["tls"] and not cfg.security.insecure
        assert str(cfg.security.admin_token_file).startswith(mounts["admin-token"] + "/")
        assert cfg.listen.endswith(f":{ports['peer']}") and cfg.admin_listen.endswith(f":{ports['admin']}")
        assert cfg.advertise == f"coterie-{i}.{svc['metadata']['name']}:{ports['peer']}"
        if i == 0:
            seed_address = cfg.advertise
            assert cfg.peers == []  # never bootstraps from itself
        else:
            assert cfg.peers == [seed_address]
        assert cfg.learner.device == ("cuda" if variant == "gpu" else "cpu")
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == ("1" if variant == "gpu" else None)


# ------------------------------------------------------------------- a pod, started for real
CSI = "csi.cert-manager.io/"
CSI_ATTRIBUTES = {
    "issuer-name",
    "issuer-kind",
    "issuer-group",
    "common-name",
    "dns-names",
    "ip-sans",
    "uri-sans",
    "duration",
    "is-ca",
    "key-usages",
    "key-encoding",
    "certificate-file",
    "privatekey-file",
    "ca-file",
    "renew-before",
    "reuse-private-key",
    "fs-group",
}
USAGES = {
    "digital signature": "digital_signature",
    "key encipherment": "key_encipherment",
    "content commitment": "content_commitment",
    "data encipherment": "data_encipherment",
    "key agreement": "key_agreement",
    "cert sign": "key_cert_sign",
    "crl sign": "crl_sign",
}
EXT_USAGES = {"server auth": ExtendedKeyUsageOID.SERVER_AUTH, "client auth": ExtendedKeyUsageOID.CLIENT_AUTH}


def csi_driver_writes(attributes: dict[str, str], pod: str, ca_dir: Path, target: Path) -> None:
    """What cert-manager's csi-driver puts in a pod's volume, from the volume's attributes (its
    documented behaviour): ${POD_NAME} & co. substituted, a fresh key (ECDSA P-256), a certificate
    with the common name, DNS/URI SANs and key usages asked for, signed by the Issuer's CA, written
    as certificate-file / privatekey-file / ca-file (default tls.crt, tls.key, ca.crt)."""
    pod_vars = {
        "POD_NAME": pod,
        "POD_NAMESPACE": "default",
        "POD_UID": "00000000-0000-0000-0000-000000000000",
        "SERVICE_ACCOUNT_NAME": "default",
    }
    a = {}
    for k, v in attributes.items():
        assert k.startswith(CSI) and k[len(CSI) :] in CSI_ATTRIBUTES, f"the csi-driver knows no attribute {k}"
        a[k[len(CSI) :]] = re.sub(r"\$\{(\w+)\}", lambda m: pod_vars[m.group(1)], v)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())

    def split(name: str) -> list[str]:
        return [s.strip() for s in a.get(name, "").split(",") if s.strip()]

    sans = [x509.DNSName(d) for d in split("dns-names")] + [
        x509.UniformResourceIdentifier(u) for u in split("uri-sans")
    ]
    usages = split("key-usages") or ["digital signature", "key encipherment"]
    assert set(usages) <= set(USAGES) | set(EXT_USAGES), usages
    ku = {v: USAGES[u] == v for u in usages for v in USAGES.values() if USAGES.get(u) == v}
    hours = float(a.get("duration", "2160h").rstrip("h"))
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, a["common-name"])] if a.get("common-name") else [])
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(hours=hours))
        .add_extension(x509.BasicConstraints(ca=a.get("is-ca") == "true", path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(**{v: ku.get(v, False) for v in USAGES.values()}, encipher_only=False, decipher_only=False),
            critical=True,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    ext = [EXT_USAGES[u] for u in usages if u in EXT_USAGES]
    if ext:
        builder = builder.add_extension(x509.ExtendedKeyUsage(ext), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    fmt = {"PKCS1": serialization.PrivateFormat.TraditionalOpenSSL, "PKCS8": serialization.PrivateFormat.PKCS8}[
        a.get("key-encoding", "PKCS1")
    ]
    target.mkdir(parents=True, exist_ok=True)
    (target / a.get("certificate-file", "tls.crt")).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (target / a.get("privatekey-file", "tls.key")).write_bytes(
        key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())
    )
    (target / a.get("ca-file", "ca.crt")).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))


def write_own_data(directory: Path, classes: list[str], seed: int) -> None:
    """A device's samples as the operator puts them on its volume: train.csv, features + label."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    rows = ["f0,f1,f2,label"] + [
        f"{x[0]:.4f},{x[1]:.4f},{x[2]:.4f},{classes[k % len(classes)]}"
        for k, x in enumerate(rng.normal(size=(3 * len(classes), 3)))
    ]
    (directory / "train.csv").write_text("\n".join(rows) + "\n")


def start_pod(
    objs: list[dict], index: int, root: Path, ca_dir: Path, *, tls_of: int | None = None, key_of: int | None = None
):
    """Pod ``index`` up to the point where its daemon would serve: its environment rendered, the
    files its volumes provide created under ``root`` (the csi-driver's certificate for pod
    ``tls_of``, default its own; ``key_of``: another pod's key swapped in), mount paths rewritten
    into ``root``, then its config and TLS credentials loaded exactly as `coterie node start` and
    the daemon do. Returns (cfg, transport)."""
    cm = one(objs, "ConfigMap")
    env = pod_environment(objs, index)
    for path, (vol, src) in volumes_of(objs).items():
        here = root / path.lstrip("/")
        if "csi" in src:
            assert src["csi"]["driver"] == "csi.cert-manager.io" and src["csi"]["readOnly"] is True
            attrs = src["csi"]["volumeAttributes"]
            # the Issuer it names is the network CA in this kustomization
            assert attrs[CSI + "issuer-name"] == one(objs, "Issuer")["metadata"]["name"]
            assert attrs.get(CSI + "issuer-kind", "Issuer") == "Issuer"
            csi_driver_writes(attrs, f"coterie-{index if tls_of is None else tls_of}", ca_dir, here)
            if key_of is not None:
                other = root / "other-pod"
                csi_driver_writes(attrs, f"coterie-{key_of}", ca_dir, other)
                key_file = attrs.get(CSI + "privatekey-file", "tls.key")
                (here / key_file).write_bytes((other / key_file).read_bytes())
        elif "secret" in src:  # the admin token Secret the operator created
            here.mkdir(parents=True)
            for item in src["secret"]["items"]:
                (here / item["path"]).write_text(secrets.token_urlsafe(32) + "\n")
            assert src["secret"]["defaultMode"] & 0o077 == 0  # the token is not for other users
        elif vol == "data":
            write_own_data(here, json.loads(cm["data"].get("COTERIE_LEARNER__CLASSES", "2")), index)
        else:
            here.mkdir(parents=True)
        env = {k: (str(root) + v if v == path or v.startswith(path + "/") else v) for k, v in env.items()}

    # `coterie node start`: the config from the environment, the preflight checks, the certificate
    cfg = load_config(environ=env)
    problem = preflight(cfg)
    assert problem is None or "already in use" in problem[0], problem  # (this machine's ports)
    load_tls(cfg)
    # the daemon: its transport from the config, the identity the certificate proves
    transport = GrpcTransport.from_config(cfg)
    if cfg.security.admin_token_file is not None:
        token = Path(cfg.security.admin_token_file).read_text().strip()
        assert len(token) >= 16
    if importlib.util.find_spec("coterie.node.learning.own_data") is not None:
        from coterie.node.learning.own_data import load_own_data

        data = load_own_data(cfg.learner)
        assert data.class_names == cfg.learner.classes and len(data.y_train) > 0
    return cfg, transport


@pytest.fixture(scope="module")
def network_ca(tmp_path_factory) -> Path:
    """The CA in the Issuer's Secret (made with `coterie ca init`, as docs/deploy-kubernetes.md says)."""
    return init_ca(tmp_path_factory.mktemp("ca"))


@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_every_pod_can_start_with_its_own_certificate(variant, tmp_path, network_ca):
    objs = render(K8S / variant)
    for i in range(one(objs, "StatefulSet")["spec"]["replicas"]):
        cfg, transport = start_pod(objs, i, tmp_path / f"pod{i}", network_ca)
        assert transport.mtls and transport.identity == f"coterie-{i}" == cfg.node_id


def _handshake(server: TLS, client: TLS, ask_for: str | None) -> None:
    """A TLS handshake between two nodes' credentials, the client asking for ``ask_for``'s name
    as the node's client does (TLS.target_name); raises ssl.SSLError when it is refused."""

    def ctx(creds, side):
        c = ssl.SSLContext(side)
        d = Path(tempfile.mkdtemp())
        (d / "c.pem").write_bytes(creds.cert_pem)
        (d / "k.pem").write_bytes(creds.key_pem)
        c.load_cert_chain(d / "c.pem", d / "k.pem")
        c.load_verify_locations(cadata=creds.ca_pem.decode())
        c.verify_mode = ssl.CERT_REQUIRED
        return c

    a, b = socket.socketpair()
    srv = ctx(server.creds, ssl.PROTOCOL_TLS_SERVER)
    cli = ctx(client.creds, ssl.PROTOCOL_TLS_CLIENT)
    errors: list[BaseException] = []

    def serve():
        try:
            with srv.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as e:
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with cli.wrap_socket(b, server_hostname=TLS.target_name(ask_for)) as s:
            s.sendall(b"x")
    finally:
        b.close()
        t.join(10)
        a.close()


def test_pods_reach_each_other_by_name_and_no_one_else(tmp_path, network_ca):
    """The csi-driver's certificates do what peers ask of them: first contact by the shared name,
    then a known peer by its own name — and a pod does not pass for another."""
    objs = render(K8S / "base")
    tls = [start_pod(objs, i, tmp_path / f"pod{i}", network_ca)[1].tls for i in range(2)]
    _handshake(tls[0], tls[1], None)  # first contact with an address
    _handshake(tls[0], tls[1], "coterie-0")  # pod 1 dials coterie-0 and gets it
    with pytest.raises(ssl.SSLCertVerificationError, match="match|mismatch"):
        _handshake(tls[0], tls[1], "coterie-1")  # coterie-0 cannot pass for coterie-1


def test_a_pod_with_another_pods_certificate_or_key_does_not_start(tmp_path, network_ca):
    objs = render(K8S / "base")
    with pytest.raises(ConfigError, match="certificate is for node 'coterie-1', but node_id is 'coterie-0'"):
        start_pod(objs, 0, tmp_path / "a", network_ca, tls_of=1)
    with pytest.raises(ConfigError, match="not the private key of the certificate"):
        start_pod(objs, 0, tmp_path / "b", network_ca, key_of=1)


@pytest.mark.parametrize(
    "attribute, value, error",
    [
        ("uri-sans", None, "names 0 node ids"),  # the node id lives in the URI SAN, not the CN
        ("certificate-file", None, "node.pem does not exist"),  # the driver's default name is tls.crt
        ("privatekey-file", "key.pem", "node.key does not exist"),
    ],
)
def test_the_certificate_attributes_are_what_the_node_reads(tmp_path, network_ca, attribute, value, error):
    """The csi-driver rendering above follows the attributes: change one the node depends on and the
    pod no longer starts (so the test passing means the manifest's attributes are right)."""
    objs = render(K8S / "base")
    pod = one(objs, "StatefulSet")["spec"]["template"]["spec"]
    attrs = next(v for v in pod["volumes"] if "csi" in v)["csi"]["volumeAttributes"]
    attrs.pop(CSI + attribute)
    if value is not None:
        attrs[CSI + attribute] = value
    with pytest.raises(ConfigError, match=error):
        start_pod(objs, 0, tmp_path, network_ca)


def test_a_pod_without_certificates_does_not_start(tmp_path, network_ca):
    """What the test above guards against: the same pod with no csi volume fails closed."""
    objs = render(K8S / "base")
    sts = one(objs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    pod["volumes"] = [v for v in pod["volumes"] if "csi" not in v]
    pod["containers"][0]["volumeMounts"] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] != "tls"]
    with pytest.raises(ConfigError, match="does not exist"):
        start_pod(objs, 0, tmp_path, network_ca)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to cross-check the rendering with")
@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_kubectl_kustomize_renders_the_same(variant):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / variant)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=lambda o: o["kind"])
    ours = sorted(render(K8S / variant), key=lambda o: o["kind"])
    assert theirs == ours
