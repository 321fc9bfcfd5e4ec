"""deploy/ agrees with the code: what the manifests set is what the engine reads and serves.

No cluster is touched: the YAML is parsed and checked against the code it deploys — the env
vars each engine container sets are ones `Settings.from_env` reads (or Ray's own), and together
they make a valid configuration; ports match CE_PORT; probe paths are routes of the gateway; one
image, tagged with the project version, carrying the Ray version the tests run; secrets are
referenced, never inlined; session hosts cannot be placed on the head or the gateway nodes; the
cluster launcher config passes Ray's own validation; the operations guide names real metrics.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from actors.placement import HOST_CPUS
from services.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"chat-engine:{VERSION}"

#: variables an engine container may set that Settings does not read, and why
FOREIGN_ENV = {
    "RAY_AUTH_MODE": "Ray token authentication (read by Ray)",
    "RAY_AUTH_TOKEN": "Ray token authentication (read by Ray)",
    "POD_IP": "the downward API, for `ray start --node-ip-address`",
    "PYTHONUNBUFFERED": "Python itself",
    "RAY_worker_niceness": "Ray's raylet: the niceness it starts worker processes at",
}


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_docs() -> list[dict[str, Any]]:
    return [d for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml" for d in load_all(f)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in k8s_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def settings_variables() -> set[str]:
    """Every variable Settings.from_env looks at (recorded, not parsed from source)."""

    class Recording(dict):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def get(self, key, default=None):
            self.seen.add(key)
            return super().get(key, default)

    env = Recording()
    Settings.from_env(env)
    return env.seen


def gateway_deployment() -> dict[str, Any]:
    return one("Deployment", "chat-engine-gateway")


def gateway_container() -> dict[str, Any]:
    (container,) = [c for c in gateway_deployment()["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    return container


def pod_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def ray_cluster() -> dict[str, Any]:
    return one("RayCluster")


def ray_pod_specs() -> list[dict[str, Any]]:
    spec = ray_cluster()["spec"]
    return [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]


def engine_containers() -> list[dict[str, Any]]:
    """Every Kubernetes container that runs the engine's image."""
    specs = [gateway_deployment()["spec"]["template"]["spec"], *ray_pod_specs()]
    return [c for spec in specs for c in pod_containers(spec)]


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def compose_engine_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose()["services"].items() if s.get("image") == IMAGE}


def interpolate(value: str, shell: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?message}` against `shell`."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if shell.get(name):
            return shell[name]
        if op == ":?":
            raise AssertionError(f"compose needs {name}: {arg}")
        return arg or ""

    return re.sub(r"\$\{(\w+)(:-|:\?)?([^}]*)\}", sub, value)


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def dockerfile_env() -> dict[str, str]:
    """The ENV instructions of the Dockerfile (continuation lines joined)."""
    env: dict[str, str] = {}
    lines = iter(dockerfile().splitlines())
    for line in lines:
        if not line.startswith("ENV "):
            continue
        text = line[4:]
        while text.endswith("\\"):
            text = text[:-1] + " " + next(lines)
        for pair in shlex.split(text):
            name, _, value = pair.partition("=")
            env[name] = value
    return env


def secret_values() -> dict[tuple[str, str], str]:
    return {(d["metadata"]["name"], k): v for d in k8s_docs() if d["kind"] == "Secret"
            for k, v in d.get("stringData", {}).items()}


def resolved_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the pod would see it (secrets from the Secret manifests)."""
    env: dict[str, str] = {}
    secrets = secret_values()
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = "10.1.2.3"
    return env


def gateway_routes() -> set[str]:
    from services.gateway.app import build_app
    from services.gateway.common import GatewayDeps

    app = build_app(GatewayDeps(router=None, tenants=None, tools=None, calls=None, sessions=None, configs=None,
                                secret_box=None))
    return {r.canonical for r in app.router.resources()}


# -- kinds and images --------------------------------------------------------------------------------


def test_the_kubernetes_manifests_parse_into_the_expected_kinds_and_kustomize_lists_them_all():
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in k8s_docs())
    assert kinds == [
        ("Deployment", "chat-engine-gateway"), ("NetworkPolicy", "chat-engine-session-hosts"),
        ("PodDisruptionBudget", "chat-engine-gateway"), ("RayCluster", "chat-engine"), ("Secret", "chat-engine"), ("Secret", "chat-engine-ray-auth"),
        ("Service", "chat-engine-gateway"),
    ]
    assert all(d["apiVersion"] == {"RayCluster": "ray.io/v1", "Deployment": "apps/v1", "Service": "v1",
                                   "Secret": "v1", "PodDisruptionBudget": "policy/v1",
                                   "NetworkPolicy": "networking.k8s.io/v1"}[d["kind"]] for d in k8s_docs())
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")
    assert kustomization["images"] == [{"name": "chat-engine", "newName": "chat-engine", "newTag": VERSION}]


def test_one_image_tagged_with_the_project_version_runs_every_engine_process():
    k8s_images = {c["image"] for c in engine_containers()}
    assert k8s_images == {IMAGE}
    services = compose_engine_services()
    assert set(services) == {"model", "ray-head", "ray-worker", "migrate", "gateway"}
    assert all(s["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"} for s in services.values())
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert launcher["docker"]["image"] == IMAGE
    assert f"-t {IMAGE} " in dockerfile()


def test_the_image_and_the_ray_cluster_carry_the_ray_version_the_tests_run():
    versions = set(re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile(), flags=re.MULTILINE))
    assert versions == {ray.__version__}, versions
    assert ray_cluster()["spec"]["rayVersion"] == ray.__version__
    assert 'ray[default]==${RAY_VERSION}' in dockerfile()  # the dashboard agent KubeRay's probes call
    python = re.search(r"^ARG PYTHON_VERSION=(\S+)$", dockerfile(), flags=re.MULTILINE)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert python and requires == f">={python.group(1)}"


# -- environment -------------------------------------------------------------------------------------


def test_every_variable_an_engine_container_sets_is_read_by_settings_or_by_ray():
    known = settings_variables() | set(FOREIGN_ENV)
    assert {"DATABASE_URL", "RAY_ADDRESS", "CE_SECRET_KEY", "ANTHROPIC_API_KEY", "CE_SHARDS", "CE_PORT"} <= known
    set_somewhere: dict[str, str] = {}
    for c in engine_containers():
        for e in c.get("env", []):
            set_somewhere[e["name"]] = f"kubernetes container {c['name']}"
    for name, service in compose_engine_services().items():
        for var in service.get("environment", {}):
            set_somewhere[var] = f"compose service {name}"
    for var in dockerfile_env():
        set_somewhere[var] = "Dockerfile ENV"
    unknown = {v: where for v, where in set_somewhere.items() if v not in known}
    assert unknown == {}, f"set but read by nothing: {unknown}"
    assert "CE_PORT" in set_somewhere and "RAY_ADDRESS" in set_somewhere


def test_the_gateway_environment_is_a_valid_configuration_with_its_secrets_from_secrets():
    container = gateway_container()
    env = resolved_env(container)
    settings = Settings.from_env(env)  # raises ConfigError with the variable at fault
    assert (settings.placement, settings.host, settings.log_format) == ("sharded", "0.0.0.0", "json")
    assert settings.database_url and settings.secret_keys and settings.anthropic_api_key
    by_name = {e["name"]: e for e in container["env"]}
    for secret in ("DATABASE_URL", "CE_SECRET_KEY", "ANTHROPIC_API_KEY", "RAY_AUTH_TOKEN"):
        assert "valueFrom" in by_name[secret] and "value" not in by_name[secret], f"{secret} must come from a Secret"
    init_env = resolved_env(gateway_deployment()["spec"]["template"]["spec"]["initContainers"][0])
    assert Settings.from_env(init_env).database_url == settings.database_url


def test_the_gateway_joins_the_ray_cluster_at_its_head_service_with_the_cluster_token():
    env = {e["name"]: e for e in gateway_container()["env"]}
    rc = ray_cluster()
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    gcs_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "gcs-server")
    assert env["RAY_ADDRESS"]["value"] == f"{rc['metadata']['name']}-head-svc:{gcs_port}"
    assert env["RAY_AUTH_MODE"]["value"] == rc["spec"]["authOptions"]["mode"] == "token"
    token_ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token_ref == {"name": rc["spec"]["authOptions"]["secretName"], "key": "auth_token"}
    assert (token_ref["name"], "auth_token") in secret_values()
    script = " ".join(gateway_container()["args"])
    assert 'ray start --address="$RAY_ADDRESS"' in script and "exec chat-engine serve" in script
    assert gateway_deployment()["spec"]["template"]["spec"]["initContainers"][0]["command"] == ["chat-engine", "migrate"]


def test_every_secret_reference_names_a_key_of_a_secret_manifest():
    refs = [e["valueFrom"]["secretKeyRef"] for c in engine_containers() for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})]
    assert refs
    assert all((r["name"], r["key"]) in secret_values() for r in refs), refs


# -- ports and probes --------------------------------------------------------------------------------


def test_ports_and_probes_match_ce_port_and_the_gateway_routes():
    container = gateway_container()
    port = Settings.from_env(resolved_env(container)).port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": port}
    routes = gateway_routes()
    probes = {k: container[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {k: p["path"] for k, p in probes.items()} == {
        "startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe in probes.values():
        assert probe["path"] in routes and probe["port"] in ("http", port)
    annotations = gateway_deployment()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in routes and int(annotations["prometheus.io/port"]) == port
    service = one("Service", "chat-engine-gateway")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    labels = gateway_deployment()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert re.search(rf"^EXPOSE {port}$", dockerfile(), flags=re.MULTILINE)
    assert Settings.from_env(dockerfile_env()).port == port  # the image's default matches


def test_the_compose_gateway_is_a_valid_configuration_serving_its_published_port():
    gateway = compose()["services"]["gateway"]
    shell = {"CE_SECRET_KEY": "a-key"}
    env = {k: interpolate(str(v), shell) for k, v in gateway["environment"].items()}
    settings = Settings.from_env(env)
    assert settings.ray_address == "ray-head:6379" and settings.database_url
    assert gateway["ports"] == [f"{settings.port}:{settings.port}"]
    healthcheck = gateway["healthcheck"]["test"]
    url = next(a for a in healthcheck if a.startswith("http"))
    assert url.endswith(f":{settings.port}/readyz") and "/readyz" in gateway_routes()
    with pytest.raises(AssertionError, match="compose needs CE_SECRET_KEY"):
        interpolate(str(gateway["environment"]["CE_SECRET_KEY"]), {})
    migrate = compose()["services"]["migrate"]
    assert migrate["environment"]["DATABASE_URL"] == env["DATABASE_URL"]


# -- placement of the session hosts ------------------------------------------------------------------


def ray_start_flags(command: str) -> dict[str, str]:
    words = shlex.split(command.replace("\\\n", " "))
    start = words.index("start")
    flags = {}
    for w in words[start + 1:]:
        if w.startswith("--"):
            key, _, value = w[2:].partition("=")
            flags[key] = value
        elif w in ("&&", ";"):
            break
    return flags


def test_session_hosts_can_land_only_on_the_session_host_nodes():
    # a host reserves HOST_CPUS (so SPREAD spreads it): a node started with 0 CPUs never gets one
    assert HOST_CPUS > 0
    spec = ray_cluster()["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert all(float(g["rayStartParams"]["num-cpus"]) >= 1 for g in spec["workerGroupSpecs"])
    gateway_script = gateway_container()["args"][0]
    assert ray_start_flags(gateway_script)["num-cpus"] == "0"
    services = compose()["services"]
    assert ray_start_flags(" ".join(services["ray-head"]["command"]))["num-cpus"] == "0"
    assert float(ray_start_flags(" ".join(services["ray-worker"]["command"]))["num-cpus"]) >= 1
    assert ray_start_flags(services["gateway"]["command"][-1])["num-cpus"] == "0"
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert ray_start_flags(launcher["head_start_ray_commands"][-1])["num-cpus"] == "0"
    assert "num-cpus" not in ray_start_flags(launcher["worker_start_ray_commands"][-1])  # all the machine's


def test_the_cluster_launcher_config_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(config))  # raises on an unknown field or a wrong type
    assert config["provider"]["type"] == "local"
    assert "--env-file /etc/chat-engine/ray.env" in config["docker"]["run_options"]
    assert ray_start_flags(config["head_start_ray_commands"][-1])["port"] == "6379"
    assert "$RAY_HEAD_IP:6379" in config["worker_start_ray_commands"][-1]


# -- the operator's guide ----------------------------------------------------------------------------


def test_the_operations_guide_names_only_metrics_the_gateway_exports_and_real_commands():
    from services.gateway.metrics import GatewayMetrics

    text = (DEPLOY / "OPERATIONS.md").read_text()
    exported = set()
    for metric in GatewayMetrics().registry.collect():  # names as exposed: counters end in _total
        exported.add(metric.name + ("_total" if metric.type == "counter" else ""))
    migrations = "".join(p.read_text() for p in (ROOT / "storage" / "migrations").glob("*.sql"))
    tables = set(re.findall(r"CREATE TABLE (?:IF NOT EXISTS )?(ce_[a-z_]+)", migrations))
    named = set(re.findall(r"\bce_[a-z_]+\b", text)) - tables  # tables (and the ce_cluster channel)
    assert named and named <= exported, named - exported
    from app.cli import main

    assert "chat-engine scale" in text and "chat-engine restart-hosts" in text
    for command in set(re.findall(r"chat-engine ([a-z][a-z-]*)", text)):
        with pytest.raises(SystemExit) as exit_:  # argparse: --help exits 0, an unknown command 2
            main([command, "--help"])
        assert exit_.value.code == 0, f"OPERATIONS.md names 'chat-engine {command}', which the CLI lacks"


def test_only_gateways_and_the_ray_clusters_own_pods_reach_the_session_hosts_lanes():
    # a lane listens on a port its host picks: the policy admits by peer, every other pod is kept out
    policy = one("NetworkPolicy")
    hosts = one("RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= hosts.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    assert "ports" not in rule
    admitted = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert all(set(peer) == {"podSelector"} for peer in rule["from"])  # no namespace or address ranges
    gateway = one("Deployment", "chat-engine-gateway")["spec"]["template"]["metadata"]["labels"]
    head = one("RayCluster")["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert sorted(a["app.kubernetes.io/component"] for a in admitted) == ["gateway", "ray-head", "session-hosts"]
    for labels in (gateway, head, hosts):
        assert any(a.items() <= labels.items() for a in admitted), labels
