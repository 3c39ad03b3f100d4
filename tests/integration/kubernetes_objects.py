"""Reading rendered Kubernetes objects as kubelet and a network plugin would: a pod's
environment and its arguments with ``$(VAR)`` expanded, and whether the network policies
let one pod reach another on a port. For tests/integration/test_kubernetes_manifests.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kustomize(path: Path) -> list[dict]:
    """The objects ``kubectl kustomize path`` renders."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed; the manifests render with `kubectl kustomize` (1.27 or later)")
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def selects(selector: dict, labels: dict) -> bool:
    """A label selector of matchLabels only (the manifests use no expressions)."""
    assert not selector.get("matchExpressions"), "matchExpressions are not read here"
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in ``args``."""
    for index, arg in enumerate(args):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and index + 1 < len(args):
            return args[index + 1]
    return None


@dataclass
class Pod:
    """The pod template of a Deployment, with the ConfigMaps it reads."""

    deployment: dict
    config_maps: dict[str, dict]

    @property
    def name(self) -> str:
        return self.deployment["metadata"]["name"]

    @property
    def spec(self) -> dict:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict:
        return self.deployment["spec"]["template"]["metadata"]["labels"]

    @property
    def main(self) -> dict:
        return self.spec["containers"][0]

    def containers(self) -> list[dict]:
        return [*self.spec.get("initContainers", []), *self.spec["containers"]]

    def environment(self, container: dict) -> dict[str, str]:
        """Variable → value; a downward-API variable's value is ``<fieldPath>``."""
        values: dict[str, str] = {}
        for source in container.get("envFrom", []):
            values.update(self.config_maps[source["configMapRef"]["name"]]["data"])
        for variable in container.get("env", []):
            if "value" in variable:
                values[variable["name"]] = variable["value"]
            else:
                values[variable["name"]] = f"<{variable['valueFrom']['fieldRef']['fieldPath']}>"
        return values

    def args(self, container: dict) -> list[str]:
        """The container's arguments as kubelet passes them: ``$(VAR)`` expanded."""
        values = self.environment(container)
        return [_REFERENCE.sub(lambda m: values.get(m.group(1), m.group(0)), arg) for arg in container["args"]]


def pods(objects: list[dict]) -> dict[str, Pod]:
    config_maps = {obj["metadata"]["name"]: obj for obj in of_kind(objects, "ConfigMap")}
    return {d["metadata"]["name"]: Pod(d, config_maps) for d in of_kind(objects, "Deployment")}


class Policies:
    """The NetworkPolicies of one namespace."""

    def __init__(self, objects: list[dict]):
        self.policies = of_kind(objects, "NetworkPolicy")

    def _of(self, pod: Pod, direction: str) -> list[dict]:
        return [rule for policy in self.policies if selects(policy["spec"]["podSelector"], pod.labels)
                for rule in policy["spec"].get(direction, [])]

    def ingress_ports(self, pod: Pod) -> set[int]:
        return {port["port"] for rule in self._of(pod, "ingress") for port in rule.get("ports", [])}

    def allows(self, source: Pod, destination: Pod, port: int) -> bool:
        """Egress from ``source`` and ingress into ``destination`` on TCP ``port``."""
        out = any(self._matches(rule, "to", destination, port) for rule in self._of(source, "egress"))
        into = any(self._matches(rule, "from", source, port) for rule in self._of(destination, "ingress"))
        return out and into

    @staticmethod
    def _matches(rule: dict, side: str, peer: Pod, port: int) -> bool:
        ports = rule.get("ports")
        if ports and not any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            return False
        peers = rule.get(side)
        return not peers or any("podSelector" in p and "namespaceSelector" not in p
                                and selects(p["podSelector"], peer.labels) for p in peers)
