"""The Kubernetes manifests (deploy/kubernetes): every overlay renders with ``kubectl
kustomize``; every object is valid against the schemas of a pinned Kubernetes release
(kubernetes-validate, strict), the ServiceMonitor (a CRD, not in them) checked by hand;
checkov fails none of its checks but the two skipped with a reason; and what kvroute relies
on holds: every container runs as non-root and locked down, every process parses its
arguments, workers advertise their pod IP and register through the headless Service, the
probes are the ones that reflect registration and engine health, the network policies open
exactly the ports the processes listen on (and every connection kvroute makes), and the
grace periods outlast the drain."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from foundation import config
from kvroute.cli import build_parser, build_probe_parser
from orchestrator.settings import OrchestratorSettings
from tests.integration.kubernetes_objects import Policies, flag, kustomize, of_kind, pods, selects
from worker.orchestrator_targets import DnsName, parse_entry

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.32.0"
# Installed by `make setup` in a virtual environment of its own (its pins clash with vLLM's).
CHECKOV = Path(os.environ.get("KVROUTE_CHECKOV", REPO / ".venv-checkov" / "bin" / "checkov"))
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor")}
# Each skipped where it applies with a checkov.io/skipN annotation that says why.
SKIPPED_CHECKS = {"CKV_K8S_43", "CKV_K8S_15"}
PORT_FLAGS = ("--port", "--admin-port", "--registry-port", "--rpc-port", "--kv-events-port", "--transfer-port")
ORCHESTRATOR_GRACEFUL_SECONDS = 10  # orchestrator.app: running requests' time after SIGTERM
ENGINE_STOP_SECONDS = 10  # a worker's lease release and engine shutdown after its drain
RENDERS = ("cpu", "gpu", "cpu+servicemonitor")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    # The ServiceMonitor component as an operator adds it: an overlay of their own on ours.
    monitored = tmp_path_factory.mktemp("monitored")
    root = os.path.relpath(MANIFESTS, monitored)
    (monitored / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "kvroute",
        "resources": [f"{root}/overlays/cpu"], "components": [f"{root}/components/servicemonitor"]}))
    return {"cpu": kustomize(MANIFESTS / "overlays" / "cpu"), "gpu": kustomize(MANIFESTS / "overlays" / "gpu"),
            "cpu+servicemonitor": kustomize(monitored)}


@pytest.mark.parametrize("render", RENDERS)
def test_every_object_is_valid_for_the_pinned_kubernetes_release(rendered, render):
    for obj in rendered[render]:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_RESOURCES:
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    namespaced = [obj for obj in rendered[render] if obj["kind"] != "Namespace"]
    assert {obj["metadata"].get("namespace") for obj in namespaced} == {"kvroute"}


def test_strict_validation_refuses_a_misspelt_field(rendered):
    deployment = json.loads(json.dumps(of_kind(rendered["cpu"], "Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_servicemonitor_scrapes_every_orchestrator_as_job_kvroute(rendered):
    objects = rendered["cpu+servicemonitor"]
    (monitor,) = of_kind(objects, "ServiceMonitor")
    services = [s for s in of_kind(objects, "Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in services] == ["kvroute-admin"]
    assert services[0]["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "kvroute"  # the alert rules' job
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["admin"] and "admin" in port_names
    orchestrator = pods(objects)["kvroute-orchestrator"]
    assert selects({"matchLabels": services[0]["spec"]["selector"]}, orchestrator.labels)


def test_checkov_fails_nothing_it_was_not_told_why_to_skip(rendered, tmp_path):
    if not CHECKOV.exists():
        pytest.fail(f"checkov not found at {CHECKOV}; `make setup` installs it into .venv-checkov")
    for render, objects in rendered.items():
        (tmp_path / f"{render}.yaml").write_text(yaml.safe_dump_all(objects))
    done = subprocess.run([str(CHECKOV), "--directory", str(tmp_path), "--framework", "kubernetes", "--skip-download",
                           "--output", "json", "--quiet"], capture_output=True, text=True, timeout=300)
    report = json.loads(done.stdout)
    assert report["summary"]["parsing_errors"] == 0 and report["summary"]["resource_count"] > 0
    failed = [(c["check_id"], c["resource"]) for c in report["results"].get("failed_checks", [])]
    assert not failed and done.returncode == 0, failed
    for objects in rendered.values():
        for obj in objects:
            for key, value in obj["metadata"].get("annotations", {}).items():
                if key.startswith("checkov.io/skip"):
                    check, _, reason = value.partition("=")
                    assert check in SKIPPED_CHECKS and len(reason) > 20, f"{obj['metadata']['name']}: {value}"


@pytest.mark.parametrize("render", RENDERS)
def test_every_container_runs_as_non_root_and_locked_down(rendered, render):
    for pod in pods(rendered[render]).values():
        context = pod.spec["securityContext"]
        assert context["runAsNonRoot"] and context["runAsUser"] >= 10000, pod.name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, pod.name
        # The orchestrator reads KVROUTE_* as settings: no Service's variables may reach it.
        assert pod.spec["enableServiceLinks"] is False and pod.spec["automountServiceAccountToken"] is False
        for container in pod.containers():
            assert "command" not in container, "the image's entrypoint, tini, must stay PID 1 to pass SIGTERM on"
            assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
            assert container["resources"]["requests"] and container["resources"]["limits"]


@pytest.mark.parametrize("render", RENDERS)
def test_every_process_accepts_its_arguments(rendered, render):
    """What each container runs parses with kvroute's own parser, as does each exec probe; the
    orchestrator's flags and environment make valid settings."""
    for pod in pods(rendered[render]).values():
        for container in pod.containers():
            args = pod.args(container)
            assert args[0] == "kvroute" and "$(" not in " ".join(args), args
            parsed = build_parser().parse_args(args[1:])
            if parsed.command == "orchestrator":
                config.load(OrchestratorSettings, parsed, environ=pod.environment(container))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = pod.main[probe].get("exec", {}).get("command")
            if command:
                build_probe_parser().parse_args(command[1:])


@pytest.mark.parametrize("render", RENDERS)
def test_workers_advertise_their_pod_ip_and_register_with_every_orchestrator(rendered, render):
    objects = rendered[render]
    everything = pods(objects)
    orchestrator = everything.pop("kvroute-orchestrator")
    (registry,) = [s for s in of_kind(objects, "Service") if s["metadata"]["name"] == "kvroute-registry"]
    assert registry["spec"]["clusterIP"] == "None" and registry["spec"]["publishNotReadyAddresses"] is True
    registry_port = int(flag(orchestrator.args(orchestrator.main), "--registry-port"))
    assert [p["port"] for p in registry["spec"]["ports"]] == [registry_port]
    assert set(everything) == {"kvroute-prefill", "kvroute-decode", "kvroute-unified"}
    for name, worker in everything.items():
        args = worker.args(worker.main)
        assert args[1] == f"{name.removeprefix('kvroute-')}-worker"
        assert flag(args, "--host") == "<status.podIP>" and flag(args, "--worker-id") == "<metadata.name>"
        assert parse_entry(flag(args, "--orchestrator")) == DnsName("kvroute-registry", registry_port)
        assert flag(args, "--max-model-len") == orchestrator.environment(orchestrator.main)["KVROUTE_MAX_MODEL_LEN"]


@pytest.mark.parametrize("render", RENDERS)
def test_cluster_keys_come_from_secrets_through_a_private_copy(rendered, render):
    """Secret volumes fail the key loader's check (tests/unit/test_cluster_keys.py): an init
    container installs a private copy on a memory volume, and the process reads that."""
    for pod in pods(rendered[render]).values():
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        for volume in volumes.values():
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] & 0o337 == 0, volume  # nobody writes, others read nothing
        (install,) = [c for c in pod.spec["initContainers"] if c["name"] == "install-keys"]
        source, target = install["args"][3:5]
        mounts = {m["mountPath"]: m["name"] for m in install["volumeMounts"]}
        assert "secret" in volumes[mounts[source]]
        keys = flag(pod.args(pod.main), "--cluster-keys")
        assert keys == target and volumes[mounts[str(Path(target).parent)]]["emptyDir"]["medium"] == "Memory"
        assert mounts[source] not in {m["name"] for m in pod.main["volumeMounts"]}, pod.name


@pytest.mark.parametrize("render", RENDERS)
def test_probes_reflect_registration_and_engine_health(rendered, render):
    everything = pods(rendered[render])
    orchestrator = everything.pop("kvroute-orchestrator")
    assert orchestrator.main["readinessProbe"]["httpGet"] == {"path": "/health", "port": "api"}
    assert orchestrator.main["livenessProbe"]["httpGet"]["path"] != "/health"  # workers may all be away
    for worker in everything.values():
        status_file = flag(worker.args(worker.main), "--status-file")
        commands = {probe: worker.main[probe]["exec"]["command"]
                    for probe in ("startupProbe", "livenessProbe", "readinessProbe")}
        for probe, command in commands.items():
            assert command[:3] == ["kvroute", "probe", "worker"] and flag(command, "--status-file") == status_file
            assert flag(command, "--check") == ("ready" if probe == "readinessProbe" else None), probe
        # Model load is the startup probe's: minutes, where liveness gives up in one.
        startup, liveness = worker.main["startupProbe"], worker.main["livenessProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        assert liveness["periodSeconds"] * liveness["failureThreshold"] <= 120


@pytest.mark.parametrize("render", RENDERS)
def test_network_policies_open_exactly_the_ports_the_processes_listen_on(rendered, render):
    objects = rendered[render]
    policies, everything = Policies(objects), pods(objects)
    for pod in everything.values():
        listening = {int(flag(pod.args(pod.main), name)) for name in PORT_FLAGS if flag(pod.args(pod.main), name)}
        assert listening == {p["containerPort"] for p in pod.main["ports"]}, pod.name
        assert policies.ingress_ports(pod) == listening, pod.name
    orchestrator, workers = everything.pop("kvroute-orchestrator"), list(everything.values())
    orchestrator_args = orchestrator.args(orchestrator.main)
    for worker in workers:
        worker_args = worker.args(worker.main)
        assert policies.allows(worker, orchestrator, int(flag(orchestrator_args, "--registry-port")))
        for name in ("--rpc-port", "--kv-events-port", "--transfer-port"):
            assert policies.allows(orchestrator, worker, int(flag(worker_args, name))), name
        for other in workers:
            assert policies.allows(other, worker, int(flag(worker_args, "--transfer-port")))
            assert not policies.allows(other, worker, int(flag(worker_args, "--rpc-port")))
        assert not policies.allows(worker, orchestrator, int(flag(orchestrator_args, "--admin-port")))


@pytest.mark.parametrize("render", RENDERS)
def test_grace_periods_outlast_the_drain(rendered, render):
    everything = pods(rendered[render])
    orchestrator = everything.pop("kvroute-orchestrator")
    pause = int(orchestrator.main["lifecycle"]["preStop"]["exec"]["command"][1])
    assert orchestrator.spec["terminationGracePeriodSeconds"] > pause + ORCHESTRATOR_GRACEFUL_SECONDS
    for worker in everything.values():
        drain = float(flag(worker.args(worker.main), "--drain-seconds"))
        assert "lifecycle" not in worker.main  # SIGTERM itself drains; a preStop hook would only delay it
        assert worker.spec["terminationGracePeriodSeconds"] >= drain + ENGINE_STOP_SECONDS, worker.name


@pytest.mark.parametrize("render", RENDERS)
def test_every_deployment_has_a_disruption_budget_of_one_pod(rendered, render):
    budgets = of_kind(rendered[render], "PodDisruptionBudget")
    for pod in pods(rendered[render]).values():
        (budget,) = [b for b in budgets if selects(b["spec"]["selector"], pod.labels)]
        assert budget["spec"]["maxUnavailable"] == 1 and budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_gpu_overlay_gives_each_worker_a_gpu_and_the_model_a_shared_volume(rendered):
    everything = pods(rendered["gpu"])
    for pod in everything.values():
        (models,) = [v for v in pod.spec["volumes"] if v["name"] == "models"]
        assert models == {"name": "models", "persistentVolumeClaim": {"claimName": "kvroute-models"}}
        if pod.name != "kvroute-orchestrator":
            assert pod.main["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in str(pods(rendered["cpu"]))
    (claim,) = of_kind(rendered["gpu"], "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
