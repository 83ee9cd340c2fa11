"""deploy/kubernetes and the Dockerfile: schema-valid, and consistent with each other and with
the server (flags it accepts, metrics it exports, the drain it does on SIGTERM).

Core kinds are validated against the Kubernetes JSON schemas that the kubernetes-validate
package ships (strict: unknown fields fail), for the oldest release with gRPC probes GA (1.27)
and the newest it knows. No PyPI package ships the Prometheus Operator CRD schemas, so
ServiceMonitor and PrometheusRule are checked against deploy/kubernetes/schemas/, a strict
subset written here after the CRDs. The image itself cannot be built here (no Docker engine).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from asyncengine import EngineArgs, testing
from asyncengine.server.cli import build_parser, engine_args_from
from asyncengine.server.metrics import ServerMetrics
from asyncengine.server.options import check_options, serve_options_from
from asyncengine.server.state import LIVENESS_SERVICE

from .conftest import parse_metrics

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
K8S_VERSIONS = ("1.27", kubernetes_validate.latest_version())
# what the server needs after its drain grace period: server.stop (2 s) + handler flush (5 s)
STOP_OVERHEAD_S = 7


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(KUBE.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, d in documents() if d["kind"] == kind]
    return doc


def container() -> dict[str, Any]:
    (main,) = by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    return main


def serve_args() -> list[str]:
    return [a.split("=", 1)[0] for a in container()["args"]]


def test_every_manifest_is_valid_against_its_schema() -> None:
    own = {p.stem: json.loads(p.read_text()) for p in (KUBE / "schemas").glob("*.json")}
    kinds = set()
    for name, doc in documents():
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            schema = own[f"{doc['kind'].lower()}-monitoring-v1"]
            jsonschema.Draft202012Validator(schema).validate(doc)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{name} ({version}): {'.'.join(map(str, error.path))}: {error}")
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor",
                     "PrometheusRule", "ConfigMap", "HorizontalPodAutoscaler"}  # fmt: skip


def test_the_validators_do_reject_mistakes() -> None:
    deployment = json.loads(json.dumps(by_kind("Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    monitor = json.loads(json.dumps(by_kind("ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    schema = json.loads((KUBE / "schemas" / "servicemonitor-monitoring-v1.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(monitor)


def test_probes_use_the_grpc_health_service_and_termination_covers_the_drain() -> None:
    main = container()
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    args = dict(a.removeprefix("--").partition("=")[::2] for a in main["args"])
    assert int(args["port"]) == ports["grpc"] and int(args["metrics-port"]) == ports["metrics"]
    probes = {name: main[name]["grpc"] for name in ("startupProbe", "readinessProbe",
                                                      "livenessProbe")}  # fmt: skip
    assert all(probe["port"] == ports["grpc"] for probe in probes.values())
    # readiness follows drain (service ""); liveness must not, or a draining pod is killed
    assert probes["readinessProbe"]["service"] == ""
    assert probes["livenessProbe"]["service"] == probes["startupProbe"]["service"]
    assert probes["livenessProbe"]["service"] == LIVENESS_SERVICE
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    drain_s = float(args["drain-grace-period"])
    assert pod["terminationGracePeriodSeconds"] >= drain_s + STOP_OVERHEAD_S + 5


def test_the_deployment_passes_flags_the_server_accepts(model_dir: Callable[..., Path]) -> None:
    args = [a for a in container()["args"] if not a.startswith("--model=")]
    ns = build_parser().parse_args(["serve", f"--model={model_dir('llama')}", *args])
    check_options(serve_options_from(ns))
    config = engine_args_from(ns).create_engine_config()
    assert config.scheduler_config.expected_concurrency == 192
    assert serve_args().count("--model") == 1


def test_service_is_headless_and_monitoring_and_scaling_point_at_the_right_things(
    model_dir: Callable[..., Path],
) -> None:
    deployment, service = by_kind("Deployment"), by_kind("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert by_kind("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= (
        pod_labels.items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {
        p["name"] for p in container()["ports"]
    }
    monitor = by_kind("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    hpa = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # every metric named by the adapter, the autoscaler and the alerts is one the server exports
    exported = exported_metric_names(model_dir("llama"))
    adapter = yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])
    renamed = {rule["name"]["as"] for rule in adapter["rules"]}
    for rule in adapter["rules"]:
        assert metric_names(rule["seriesQuery"]) <= exported
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= renamed
    rules = by_kind("PrometheusRule")["spec"]["groups"][0]["rules"]
    assert any("block_usage_ratio" in r["expr"] and "0.85" in r["expr"] for r in rules)
    for rule in rules:
        assert metric_names(rule["expr"]) <= exported, rule["alert"]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"asyncengine_[a-z_]+", expr))


def exported_metric_names(model: Path) -> set[str]:
    args = EngineArgs(model=str(model), device="cpu", num_gpu_blocks_override=8)
    metrics = ServerMetrics(testing.fake_engine(args), lambda _: None, "fake")
    return {name for name, _ in parse_metrics(generate_latest(metrics.registry).decode())}


def test_dockerfile_serves_from_a_cuda_image_with_the_ports_the_deployment_uses() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+runtime", text, re.M)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}$", text, re.M)
    assert 'ENTRYPOINT ["asyncengine", "serve"]' in text
    expose = re.search(r"^EXPOSE (.+)$", text, re.M)
    assert expose is not None
    exposed = {int(p) for p in expose.group(1).split()}
    assert exposed == {p["containerPort"] for p in container()["ports"]}
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    assert re.search(r"^USER 1000$", text, re.M)
    assert by_kind("Deployment")["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 1000
