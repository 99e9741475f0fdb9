"""deploy/k8s: the StatefulSet, its headless Service and ConfigMap (base/) and the GPU overlay
(gpu/) are valid Kubernetes objects (kubernetes-validate, strict: unknown fields fail too),
they fit together, and the environment a pod gets is a valid node config for that pod.

The overlay is rendered here as kustomize does (its resources + its JSON 6902 patches, with the
``jsonpatch`` library); where ``kubectl`` is installed its own ``kubectl kustomize`` must agree."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from coterie.node.config import load_config, unknown_env

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
        targets = [o for o in objs if all(o.get("kind") == v if f == "kind" else o["metadata"].get(f) == v
                                           for f, v in p["target"].items())]
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
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                                    e["value"])
    assert container["command"] == ["/bin/sh", "-c"]
    script = container["args"][0]
    assert "exec /src/deploy/entrypoint.sh" in script
    out = subprocess.run(["/bin/sh", "-c", script.replace("exec /src/deploy/entrypoint.sh", "exec env -0")],
                         env=env, capture_output=True, text=True, timeout=30, check=True).stdout
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_every_object_is_valid_kubernetes(variant):
    objs = render(K8S / variant)
    assert sorted(o["kind"] for o in objs) == ["ConfigMap", "Service", "StatefulSet"]
    for o in objs:
        kubernetes_validate.validate(o, VERSION, strict=True)


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


@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_the_pieces_fit_together(variant):
    objs = render(K8S / variant)
    sts, svc = one(objs, "StatefulSet"), one(objs, "Service")
    spec, pod = sts["spec"], sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # the headless Service names the pods (coterie-0.coterie) and publishes them before they are ready
    assert spec["serviceName"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)

    # state on a volume claim per pod; resource requests and limits; probes on the admin /healthz
    claims = {c["metadata"]["name"] for c in spec["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert set(mounts) == claims
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) <= set(container["resources"]["limits"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "admin"}, probe

    # what each pod runs with: a valid node config, its own stable identity, nothing misspelled
    replicas = spec["replicas"]
    seed_address = None
    for i in range(replicas):
        env = pod_environment(objs, i)
        assert unknown_env(env) == []
        cfg = load_config(environ=env)
        assert cfg.node_id == f"coterie-{i}" and cfg.learner.node_index == i
        assert cfg.learner.num_nodes == replicas  # every shard has its node
        assert str(cfg.state_dir) == mounts["state"]
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


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to cross-check the rendering with")
@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_kubectl_kustomize_renders_the_same(variant):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / variant)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=lambda o: o["kind"])
    ours = sorted(render(K8S / variant), key=lambda o: o["kind"])
    assert theirs == ours
