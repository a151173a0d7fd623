"""deploy/ (issue 10, item 5), offline: every overlay renders with kustomize (``kubectl
kustomize``), lints clean with yamllint, and every rendered object validates strictly against
the Kubernetes API schemas (``kubernetes-validate``, which ships them). Then what the manifests
promise an operator: gRPC ports named ``grpc-*``, native gRPC probes with the readiness name of
each service, a drain before SIGTERM, a disruption budget per component, the NetworkPolicy
fence, GPUs in the GPU overlay, a gateway that finds each stage through its Service, and, in the
GPU overlay, encoders that share outputs through the cache's shared tier and scale on their queue.
Every container's arguments are parsed by the ``epd`` CLI itself, so a flag that drifts fails here.

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
_TIER = "epd-shared-cache"  # the optional component: Mooncake, so no gRPC health or drain of ours
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
    budgets = {doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for doc in _of_kind(docs, "PodDisruptionBudget").values()}
    assert budgets == set(workloads)
    workloads.pop(_TIER, None)
    assert set(workloads) == {f"epd-{component}" for component in _READINESS}
    for name, workload in workloads.items():
        pod = workload["spec"]["template"]
        assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "epd"
        (container,) = pod["spec"]["containers"]
        assert container["livenessProbe"]["grpc"] == {"port": 50051}
        assert container["readinessProbe"]["grpc"] == {"port": 50051, "service": _READINESS[name.removeprefix("epd-")]}
        assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        assert pod["spec"]["terminationGracePeriodSeconds"] > 30  # above --drain-grace-s
        assert "--drain-grace-s=30" in container["args"]
    for name, service in _of_kind(docs, "Service").items():
        names = [port["name"] for port in service["spec"]["ports"]]
        assert (name == _TIER or any(n.startswith("grpc-") for n in names)) and all(re.fullmatch(r"(grpc|http|tcp)-[a-z-]+", n) for n in names), names
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
    # The replicas share the key that routes items to encoders.
    assert "--affinity-key-file=/etc/epd/affinity/key" in args
    secrets = {v["secret"]["secretName"] for spec in [gateway, *(s["spec"]["template"]["spec"] for s in stages.values())] for v in spec["volumes"] if "secret" in v}
    assert secrets == {"epd-tls", "epd-gateway-token", "epd-gateway-affinity-key", "epd-handoff-key"}
    for stage in stages.values():
        stage_args = stage["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--require-client-cert" in stage_args and "--host=$(POD_IP)" in stage_args


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_epd_pods_reach_the_stages_and_only_the_public_port_is_open(overlay):
    docs = _render(overlay)
    policies = _of_kind(docs, "NetworkPolicy")
    stages = policies["epd-stages-only-from-epd"]["spec"]
    (fenced,) = stages["podSelector"]["matchExpressions"]
    assert (fenced["key"], fenced["operator"]) == ("app.kubernetes.io/component", "In")
    # Every pod but the gateway's: the stages, and the shared tier where the overlay has one.
    workloads = [*_of_kind(docs, "StatefulSet").values(), *_of_kind(docs, "Deployment").values()]
    components = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for w in workloads}
    assert set(fenced["values"]) == components - {"gateway"} >= {"encoder", "prefill", "decode"}
    assert stages["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "epd"}}}]}]
    gateway = policies["epd-gateway-public-port"]["spec"]
    assert gateway["ingress"][0] == {"ports": [{"port": "grpc-gateway", "protocol": "TCP"}]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_engine_gets_as_many_openmp_threads_as_cores_it_requests(overlay):
    """Torch would size each engine's OpenMP pool to the node's cores and oversubscribe them."""
    workloads = _of_kind(_render(overlay), "StatefulSet")
    for stage in ("encoder", "prefill", "decode"):
        (container,) = workloads[f"epd-{stage}"]["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["requests"]["cpu"]
        (threads,) = [variable for variable in container["env"] if variable["name"] == "OMP_NUM_THREADS"]
        assert threads["valueFrom"]["resourceFieldRef"] == {"containerName": stage, "resource": "requests.cpu", "divisor": "1"}


def test_the_gpu_overlay_gives_every_stage_pod_a_gpu_and_bf16():
    docs = _render("gpu")
    for stage in _of_kind(docs, "StatefulSet").values():
        (container,) = stage["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "--dtype=bfloat16" in container["args"]
    assert "nvidia.com/gpu" not in str(_of_kind(docs, "Deployment")["epd-gateway"])
    assert _of_kind(docs, "PersistentVolumeClaim")["epd-model"]["spec"]["accessModes"] == ["ReadOnlyMany"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_a_command_epd_accepts(overlay):
    from cli.commands import build_parser

    parser, docs = build_parser(), _render(overlay)
    pods = [w["spec"]["template"]["spec"] for w in [*_of_kind(docs, "StatefulSet").values(), *_of_kind(docs, "Deployment").values()]]
    containers = [c for pod in pods for c in [*pod.get("initContainers", []), *pod["containers"]]]
    assert len(containers) >= 4
    for container in containers:
        parser.parse_args(container["args"])  # SystemExit on an unknown flag or a bad value
    with pytest.raises(SystemExit):
        parser.parse_args(["encoder", "--shared-cache-masterr=epd-shared-cache:50052"])


def _args_of(workload: dict) -> dict[str, str]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(arg.removeprefix("--").partition("=")[::2] for arg in container["args"][1:])


def test_the_gpu_overlay_shares_encoder_outputs_through_the_tier_inside_the_fence():
    docs = _render("gpu")
    tier = _of_kind(docs, "Deployment")[_TIER]
    tier_args, tier_pod = _args_of(tier), tier["spec"]["template"]["metadata"]["labels"]
    ports = {port["name"]: port["port"] for port in _of_kind(docs, "Service")[_TIER]["spec"]["ports"]}
    assert tier_args["host"] == "$(POD_IP)" and (int(tier_args["port"]), int(tier_args["metadata-port"])) == (ports["tcp-master"], ports["http-metadata"])
    encoder = _args_of(_of_kind(docs, "StatefulSet")["epd-encoder"])
    assert encoder["shared-cache-master"] == f"{_TIER}:{ports['tcp-master']}"
    assert encoder["shared-cache-metadata"] == f"http://{_TIER}:{ports['http-metadata']}/metadata"
    # The tier holds encoder outputs and authenticates nothing: it is fenced like the stages.
    fence = _of_kind(docs, "NetworkPolicy")["epd-stages-only-from-epd"]["spec"]["podSelector"]["matchExpressions"][0]
    assert tier_pod["app.kubernetes.io/component"] in fence["values"] and tier_pod["app.kubernetes.io/part-of"] == "epd"
    # Optional: the one-encoder demo runs without it.
    assert "shared-cache-master" not in _args_of(_of_kind(_render("cpu-demo"), "StatefulSet")["epd-encoder"])


def test_the_gpu_overlay_scales_encoders_on_the_queue_metric_they_export():
    from epd import telemetry

    docs = _render("gpu")
    (hpa,) = _of_kind(docs, "HorizontalPodAutoscaler").values()
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", "epd-encoder") and target["name"] in _of_kind(docs, "StatefulSet")
    assert hpa["spec"]["minReplicas"] >= 2  # one encoder can always fail over to another
    (metric,) = (m["pods"]["metric"] for m in hpa["spec"]["metrics"])
    assert metric["name"] == telemetry.IN_FLIGHT._name and metric["selector"]["matchLabels"] == {"service": "encoder"}
    assert telemetry.IN_FLIGHT._labelnames == ("service",)
