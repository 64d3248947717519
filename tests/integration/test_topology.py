"""The production topology files: docker-compose.yml validates (Debian's ``docker-compose``, no
engine needed), has every service of the topology, binds host ports to 127.0.0.1, orders start
by health; the image runs as a non-root user; the collector config forwards to Jaeger."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {
    "postgres",
    "redis",
    "kafka",
    "migrate",
    "kafka-topics",
    "model",
    "server",
    "server-vllm",
    "streams",
    "worker-eval",
    "worker-train",
    "worker-train-cpu",
    "vllm",
    "otel-collector",
    "jaeger",
}
MACARON_ROLES = {
    "server",
    "server-vllm",
    "streams",
    "worker-eval",
    "worker-train",
    "worker-train-cpu",
}


def compose(*args: str, env_file: str = ".env.example") -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    assert binary is not None, "Debian's docker-compose is missing (scripts/test.sh installs it)"
    return subprocess.run(
        [binary, "--env-file", env_file, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    done = compose("--profile", "cpu", "--profile", "gpu", "config")
    assert done.returncode == 0, done.stderr
    parsed: dict[str, Any] = yaml.safe_load(done.stdout)
    return parsed


@pytest.mark.parametrize("profile", [[], ["--profile", "cpu"], ["--profile", "gpu"]])
def test_the_compose_file_validates(profile: list[str]) -> None:
    done = compose(*profile, "config", "-q")
    assert done.returncode == 0, done.stderr


def test_without_the_passwords_compose_says_what_to_set(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    done = compose("config", "-q", env_file=str(empty))
    assert done.returncode != 0 and "set POSTGRES_PASSWORD in .env" in done.stderr


def test_every_service_is_there_and_starts_in_order(config: dict[str, Any]) -> None:
    services = config["services"]
    assert set(services) == SERVICES
    for name in MACARON_ROLES:
        needs = services[name]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully", name
        assert needs["kafka-topics"]["condition"] == "service_completed_successfully", name
        environment = services[name]["environment"]
        assert environment["MACARON_EVENT_LOG"] == "kafka", name
        assert environment["MACARON_OTEL_TRACES"] == "otlp", name  # spans to the collector
        assert environment["MACARON_OTEL_ENDPOINT"] == "http://otel-collector:4318", name
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["kafka-topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in ("postgres", "redis", "kafka", "server", "server-vllm", "vllm"):
        assert "healthcheck" in services[name], name
    vllm = services["vllm"]
    assert "--enable-lora" in vllm["command"]
    # The CPU profile's server runs the model; the GPU profile's uses the vLLM replica, once
    # it is healthy, with the rank limit the replica was started with.
    assert services["server"]["profiles"] == ["cpu"]
    assert "MACARON_ENGINE" not in services["server"]["environment"]
    fleet = services["server-vllm"]
    assert fleet["profiles"] == ["gpu"]
    assert fleet["environment"]["MACARON_ENGINE"] == "vllm"
    assert fleet["environment"]["MACARON_VLLM_URLS"] == "http://vllm:8000"
    rank = vllm["command"][vllm["command"].index("--max-lora-rank") + 1]
    assert fleet["environment"]["MACARON_VLLM_MAX_LORA_RANK"] == rank
    assert fleet["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert [v.split(":")[1] for v in vllm["volumes"]] == ["/var/lib/macaron"]  # the adapters
    for name in ("vllm", "worker-train"):
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"], name


def test_host_ports_bind_loopback_only(config: dict[str, Any]) -> None:
    published = [
        port for service in config["services"].values() for port in service.get("ports", [])
    ]
    assert published and all(port.startswith("127.0.0.1:") for port in published)


def test_the_image_runs_as_a_user_and_the_collector_feeds_jaeger() -> None:
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text().splitlines()
    assert sum(line.startswith("FROM ") for line in dockerfile) == 2  # multi-stage
    [user] = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert user not in {"root", "0"}
    collector = yaml.safe_load((ROOT / "infra" / "otel" / "collector.yaml").read_text())
    assert "otlp" in collector["receivers"]
    assert collector["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"


def test_the_kubernetes_manifests_cover_the_same_roles() -> None:
    documents = list(yaml.safe_load_all((ROOT / "infra" / "k8s" / "macaron.yaml").read_text()))
    deployments = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Deployment"}
    assert set(deployments) == {
        "server",
        "streams",
        "worker-eval",
        "worker-train",
        "otel-collector",
        "jaeger",
    }
    assert all(d["metadata"]["namespace"] == "macaron" for d in documents)
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        if container["image"].startswith("macaron:"):  # our image runs as its user
            assert pod["securityContext"]["runAsNonRoot"] is True, name
    [setup] = [d for d in documents if d["kind"] == "Job"]
    command = " ".join(setup["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "db migrate" in command and "kafka topics create" in command
    # vLLM: a StatefulSet behind a headless Service, each replica named in the server's list.
    [replicas] = [d for d in documents if d["kind"] == "StatefulSet"]
    [service] = [d for d in documents if d["kind"] == "Service" and d["metadata"]["name"] == "vllm"]
    assert service["spec"]["clusterIP"] == "None"
    vllm = replicas["spec"]["template"]["spec"]["containers"][0]
    assert "--enable-lora" in vllm["args"]
    [config] = [d for d in documents if d["kind"] == "ConfigMap"]
    urls = config["data"]["MACARON_VLLM_URLS"].split(",")
    assert urls == [f"http://vllm-{i}.vllm:8000" for i in range(replicas["spec"]["replicas"])]
    rank = vllm["args"][vllm["args"].index("--max-lora-rank") + 1]
    assert config["data"]["MACARON_ENGINE"] == "vllm"
    assert config["data"]["MACARON_VLLM_MAX_LORA_RANK"] == rank
