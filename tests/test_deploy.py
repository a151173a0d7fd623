"""deploy/ (issue 10, item 5), offline: every overlay renders with kustomize (``kubectl
kustomize``), lints clean with yamllint, and every rendered object validates strictly against
the Kubernetes API schemas (``kubernetes-validate``, which ships them). Then what the manifests
promise an operator: gRPC ports named ``grpc-*``, native gRPC probes with the readiness name of
each service, a drain before SIGTERM, a disruption budget per component, the NetworkPolicy
fence, GPUs in the GPU overlay, and a gateway that finds each stage through its Service.

``scripts/test.sh`` installs kubectl (Debian's kubernetes-client) where it is missing.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
OVERLAYS = ["cpu-demo", "gpu"]
KUBERNETES_VERSION = "1.30.0"
_LINT = YamlLintConfig("extends: default\nrules:\n  line-length: {max: 140}\n  document-start: disable\n  comments: {min-spaces-from-content: 1}\n")
_READINESS = {"encoder": "epd.v1.EncoderService", "prefill": "epd.v1.PrefillService", "decode": "epd.v1.DecodeService", "gateway": "epd.v1.GatewayService"}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (scripts/test.sh installs it)")


def _render(overlay: str) -> list[dict]:
    run = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def _of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def test_every_manifest_lints_clean():
    sources = sorted(DEPLOY.rglob("*.yaml"))
    assert len(sources) >= 10
    problems = [f"{path.relative_to(DEPLOY)}:{p.line}: {p.message}" for path in sources for p in linter.run(path.read_text(), _LINT)]
    assert not problems, problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(overlay):
    docs = _render(overlay)
    assert {doc["kind"] for doc in docs} >= {"Service", "StatefulSet", "Deployment", "PodDisruptionBudget", "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    # The validation can fail: a misspelt field is refused.
    broken = _of_kind(docs, "Deployment")["epd-gateway"]
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workloads_carry_probes_drain_budgets_and_named_ports(overlay):
    docs = _render(overlay)
    workloads = {**_of_kind(docs, "StatefulSet"), **_of_kind(docs, "Deployment")}
    assert set(workloads) == {f"epd-{component}" for component in _READINESS}
    budgets = {doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for doc in _of_kind(docs, "PodDisruptionBudget").values()}
    assert budgets == set(workloads)
    for name, workload in workloads.items():
        pod = workload["spec"]["template"]
        assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "epd"
        (container,) = pod["spec"]["containers"]
        assert container["livenessProbe"]["grpc"] == {"port": 50051}
        assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": _READINESS[name.removeprefix("epd-")]}
        assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        assert pod["spec"]["terminationGracePeriodSeconds"] > 30  # above --drain-grace-s
        assert "--drain-grace-s=30" in container["args"]
    for service in _of_kind(docs, "Service").values():
        names = [port["name"] for port in service["spec"]["ports"]]
        assert any(n.startswith("grpc-") for n in names) and all(re.fullmatch(r"(grpc|http|tcp)-[a-z-]+", n) for n in names), names
        if service["metadata"]["name"] != "epd-gateway":
            assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_finds_each_stage_by_its_service_and_secrets_hold_the_credentials(overlay):
    docs = _render(overlay)
    stages = _of_kind(docs, "StatefulSet")
    services = _of_kind(docs, "Service")
    gateway = _of_kind(docs, "Deployment")["epd-gateway"]["spec"]["template"]["spec"]
    args = gateway["containers"][0]["args"]
    for stage in ("encoder", "prefill", "decode"):
        listed = [a.removeprefix(f"--{stage}=") for a in args if a.startswith(f"--{stage}=")]
        assert listed == [f"dns:///epd-{stage}:50051"]
        # The name is the stage's headless Service, which selects exactly the StatefulSet's pods.
        service = services[f"epd-{stage}"]["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
        assert service["selector"] == stages[f"epd-{stage}"]["spec"]["selector"]["matchLabels"]
        assert {"name": f"grpc-{stage}", "port": 50051} in service["ports"]
    assert "--auth-token-file=/etc/epd/token/token" in args
    secrets = {v["secret"]["secretName"] for spec in [gateway, *(s["spec"]["template"]["spec"] for s in stages.values())] for v in spec["volumes"] if "secret" in v}
    assert secrets == {"epd-tls", "epd-gateway-token"}
    for stage in stages.values():
        stage_args = stage["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--require-client-cert" in stage_args and "--host=$(POD_IP)" in stage_args


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_epd_pods_reach_the_stages_and_only_the_public_port_is_open(overlay):
    policies = _of_kind(_render(overlay), "NetworkPolicy")
    stages = policies["epd-stages-only-from-epd"]["spec"]
    assert stages["podSelector"]["matchExpressions"] == [{"key": "app.kubernetes.io/component", "operator": "In", "values": ["encoder", "prefill", "decode"]}]
    assert stages["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "epd"}}}]}]
    gateway = policies["epd-gateway-public-port"]["spec"]
    assert gateway["ingress"][0] == {"ports": [{"port": "grpc-gateway", "protocol": "TCP"}]}


def test_the_gpu_overlay_gives_every_stage_pod_a_gpu_and_bf16():
    docs = _render("gpu")
    for stage in _of_kind(docs, "StatefulSet").values():
        (container,) = stage["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "--dtype=bfloat16" in container["args"]
    assert "nvidia.com/gpu" not in str(_of_kind(docs, "Deployment")["epd-gateway"])
    assert _of_kind(docs, "PersistentVolumeClaim")["epd-model"]["spec"]["accessModes"] == ["ReadOnlyMany"]
