"""deploy/kubernetes/smg and deploy/smg/launch.py: the gateway's manifests are schema-valid and
agree with the replicas' (the labels SMG selects, the port it dials, its RBAC, its scrape), and
the gateway's and the replicas' flags parse with smg's and asyncengine's own parsers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from smg.launch_router import parse_router_args

from asyncengine.server.cli import build_parser, engine_args_from

from .test_deploy import K8S_VERSIONS, KUBE, by_kind, container

SMG_KUBE = KUBE / "smg"
LAUNCHER = KUBE.parents[0] / "smg" / "launch.py"


def smg_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(SMG_KUBE.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def smg_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in smg_documents() if d["kind"] == kind]
    return doc


def gateway_args() -> tuple[Any, dict[str, Any]]:
    (main,) = smg_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    assert main["command"] == ["smg", "launch"]
    return parse_router_args(main["args"]), main


def test_every_smg_manifest_is_valid_against_its_schema() -> None:
    schema = json.loads((KUBE / "schemas" / "servicemonitor-monitoring-v1.json").read_text())
    kinds = []
    for doc in smg_documents():
        kinds.append(doc["kind"])
        if doc["kind"] == "ServiceMonitor":
            jsonschema.Draft202012Validator(schema).validate(doc)
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    assert sorted(kinds) == sorted(["ServiceAccount", "Role", "RoleBinding", "Deployment",
                                    "Service", "ServiceMonitor"])  # fmt: skip


def test_smg_discovers_the_replica_pods_on_their_grpc_port_with_kv_events_on() -> None:
    args, main = gateway_args()
    assert args.service_discovery and args.policy == "cache_aware"
    pod_labels = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert args.selector and args.selector.items() <= pod_labels.items()
    replica = container()
    ports = {p["name"]: p["containerPort"] for p in replica["ports"]}
    assert args.service_discovery_port == ports["grpc"]
    assert "--enable-kv-events" in replica["args"]
    assert args.block_size == 16  # the replicas' default block size (none passed there)
    assert not any(a.startswith("--block-size") for a in replica["args"])
    # its own namespace, from the downward API
    assert args.service_discovery_namespace == "$(POD_NAMESPACE)"
    (env,) = [e for e in main["env"] if e["name"] == "POD_NAMESPACE"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_smg_may_watch_pods_and_nothing_more() -> None:
    pod = smg_kind("Deployment")["spec"]["template"]["spec"]
    binding, role = smg_kind("RoleBinding"), smg_kind("Role")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    assert smg_kind("ServiceAccount")["metadata"]["name"] == pod["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip


def test_the_scrape_and_the_probes_point_at_the_gateways_ports() -> None:
    args, main = gateway_args()
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert (args.port, args.prometheus_port) == (ports["http"], ports["metrics"])
    assert args.health_check_port == ports["health"]
    assert main["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "health"}
    service, monitor = smg_kind("Service"), smg_kind("ServiceMonitor")
    labels = smg_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    (scraped,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert scraped["targetPort"] == "metrics"
    pod = smg_kind("Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_grace_period_secs


def load_launcher() -> Any:
    spec = importlib.util.spec_from_file_location("asyncengine_smg_launch", LAUNCHER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_launchers_dry_run_commands_parse_and_agree(model_dir: Callable[..., Path]) -> None:
    model = str(model_dir("llama"))
    out = subprocess.run(
        [sys.executable, str(LAUNCHER), "--model", model, "--replicas", "3", "--dry-run",
         "--", "--max-num-seqs", "8"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    plan = json.loads(out)
    assert len(plan["replicas"]) == 3
    targets = []
    for command in plan["replicas"]:
        assert command[1] == "serve"
        ns = build_parser().parse_args(command[1:])
        config = engine_args_from(ns).create_engine_config()
        assert config.cache_config.enable_kv_events and ns.max_num_seqs == 8
        targets.append(f"grpc://127.0.0.1:{ns.port}")
    gateway = plan["gateway"]
    assert gateway[1] == "launch"
    args = parse_router_args(gateway[2:])
    assert args.worker_urls == targets and args.policy == "cache_aware"
    assert args.model_path == model and args.block_size == config.cache_config.block_size


def test_the_launcher_refuses_an_unknown_policy() -> None:
    with pytest.raises(SystemExit):
        load_launcher().parser().parse_args(["--model", "m", "--policy", "fastest"])
