"""The deployment under infra/: the Kubernetes manifests as kustomize renders them (offline, with
kubectl's built-in kustomize), checked against Kubernetes' schemas (kubernetes-validate ships
them) and against jetllm itself: the worker's CLI, the names it gives its streams and consumers,
the metrics it exports, the drain it does on SIGTERM."""

from __future__ import annotations

import collections
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jetllm.cli import parser as jetllm_parser
from jetllm.cli.probe import REACH_TIMEOUT
from jetllm.cli.worker_cmd import check_role
from jetllm.schemas import ErrorCode
from jetllm.subjects.names import Names
from jetllm.subjects.policy import QueuePolicy
from jetllm.workers.context import Counters, WorkerContext
from jetllm.workers.kvevents import KvEventRelay
from jetllm.workers.metrics import PlaneCollector
from jetllm.workers.roles import ROLES
from jetllm.workers.running import RunningRequests
from jetllm.workers.runtime import STOP_LEFTOVERS_TIMEOUT
from jetllm.workers.slots import Slots
from jetllm.workers.state import Lifecycle

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "infra" / "k8s"
POOLS = sorted(p for p in (K8S / "pools").iterdir() if (p / "kustomization.yaml").is_file())
KUBERNETES = "1.30"
"""The oldest Kubernetes the manifests are written for (PodDisruptionBudget's
unhealthyPodEvictionPolicy is on by default from 1.27)."""
CRDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor")}
ENGINE_CLOSE = 20
"""Seconds left after the drain and the housekeeping deadline for the engine to close and the
connection to drain before the kubelet's SIGKILL."""


@functools.cache
def render(directory: Path) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl (its built-in kustomize) is needed to render infra/k8s; it works offline")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def only(docs: tuple[dict, ...], kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def container(pool: Path) -> dict:
    (worker,) = only(render(pool), "Deployment")["spec"]["template"]["spec"]["containers"]
    return worker


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def parse(c: dict, argv: list[str], monkeypatch) -> Any:
    """argv parsed by jetllm's own parser in the container's environment (its defaults read it)."""
    for name, value in env_of(c).items():
        monkeypatch.setenv(name, value)
    assert argv[0] == "jetllm", argv
    try:
        return jetllm_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"jetllm refuses {argv}")


def worker_args(pool: Path, monkeypatch) -> Any:
    c = container(pool)
    return parse(c, c["command"] + c["args"], monkeypatch)


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # no expressions to evaluate here
    return selector["matchLabels"].items() <= labels.items()


@functools.cache
def nats_values() -> dict:
    return yaml.safe_load((K8S / "nats" / "values.yaml").read_text())


def test_there_are_pools_and_every_yaml_file_parses():
    assert len(POOLS) >= 2
    files = sorted(K8S.rglob("*.yaml"))
    assert files
    for f in files:
        assert list(yaml.safe_load_all(f.read_text())), f


@pytest.mark.parametrize("directory", [*POOLS, K8S / "monitoring"], ids=lambda p: p.name)
def test_rendered_resources_pass_the_kubernetes_schemas(directory):
    docs = render(directory)
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue  # no schema offline; the tests below check what jetllm relies on
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}"
            )
    kinds = collections.Counter(d["kind"] for d in docs)
    if directory in POOLS:
        assert kinds == {"Deployment": 1, "PodDisruptionBudget": 1, "ScaledObject": 1}
        assert len({d["metadata"]["namespace"] for d in docs}) == 1


def test_each_pools_selectors_pick_its_own_pods_and_no_other_pools():
    templates = {p: only(render(p), "Deployment")["spec"]["template"]["metadata"]["labels"] for p in POOLS}
    names = set()
    for pool in POOLS:
        docs = render(pool)
        deployment, pdb, scaled = (
            only(docs, k) for k in ("Deployment", "PodDisruptionBudget", "ScaledObject")
        )
        assert selects(deployment["spec"]["selector"], templates[pool])
        for other, labels in templates.items():
            assert selects(pdb["spec"]["selector"], labels) == (other == pool), (pool.name, other.name)
        assert scaled["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": deployment["metadata"]["name"],
        }
        assert "replicas" not in deployment["spec"]  # KEDA owns it; a re-apply must not reset it
        names.add(deployment["metadata"]["name"])
    assert len(names) == len(POOLS)


def test_the_podmonitor_scrapes_every_pool_on_the_workers_metrics_port(monkeypatch):
    monitor = only(render(K8S / "monitoring"), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True  # the dashboard reads the workers' own `instance` label
    for pool in POOLS:
        assert selects(
            monitor["spec"]["selector"],
            only(render(pool), "Deployment")["spec"]["template"]["metadata"]["labels"],
        )
        (port,) = [p for p in container(pool)["ports"] if p["name"] == endpoint["port"]]
        assert port["containerPort"] == worker_args(pool, monkeypatch).metrics_port


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_the_worker_runs_with_arguments_jetllm_accepts_for_its_role(pool, monkeypatch):
    args = worker_args(pool, monkeypatch)
    assert args.command == "worker" and args.func.__name__ == "cmd_worker"
    assert check_role(args) is None
    assert args.model and args.replicas == 3  # the chart runs three JetStream servers
    labels = only(render(pool), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels["jetllm.io/role"] == args.role


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_probes_ask_this_pods_worker_and_only_liveness_tolerates_a_missing_nats(pool, monkeypatch):
    c = container(pool)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        args = parse(c, c[probe]["exec"]["command"], monkeypatch)
        assert args.command == "health" and args.local and args.no_canary
        assert args.liveness == (probe == "livenessProbe")
        # connect and registry read, one worker's answer, and the interpreter's start
        assert c[probe]["timeoutSeconds"] >= REACH_TIMEOUT + args.timeout + 2, probe
    startup = c["startupProbe"]
    assert (
        startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    )  # a big model's download and load


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_termination_grace_outlasts_the_drain_so_sigterm_alone_stops_a_worker_cleanly(pool, monkeypatch):
    c = container(pool)
    assert "lifecycle" not in c  # no preStop: SIGTERM itself drains
    grace = only(render(pool), "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= worker_args(pool, monkeypatch).grace_period + STOP_LEFTOVERS_TIMEOUT + ENGINE_CLOSE


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_credentials_come_from_secrets(pool):
    c = container(pool)
    pod = only(render(pool), "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    creds = Path(env_of(c)["NATS_CREDS"])
    (mount,) = [m for m in c["volumeMounts"] if creds.parent == Path(m["mountPath"])]
    assert mount["readOnly"] and "secretName" in volumes[mount["name"]]["secret"]
    hf = {e["name"]: e for e in c["env"]}["HF_TOKEN"]
    assert hf["valueFrom"]["secretKeyRef"]["optional"] is True  # only gated models need one


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_a_worker_asks_for_one_gpu(pool):
    resources = container(pool)["resources"]
    # Kubernetes takes extended resources only with requests equal to limits.
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_keda_reads_the_stream_and_consumer_jetllm_creates_for_the_pool(pool, monkeypatch):
    args = worker_args(pool, monkeypatch)
    names = Names(args.namespace)
    (trigger,) = only(render(pool), "ScaledObject")["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "nats-jetstream"
    assert meta["stream"] == names.jobs_stream
    queue = ROLES[args.role].queue  # a decode pool reads the generate queue
    assert meta["consumer"] == names.consumer(queue, args.served_model_name or args.model)
    assert meta["lagThreshold"] == str(args.slots)  # one worker per --slots jobs waiting or held
    host, port = meta["natsServerMonitoringEndpoint"].rsplit(":", 1)
    assert host.startswith("nats-headless.") and int(port) == nats_values()["config"]["monitor"]["port"]
    assert env_of(container(pool))["NATS_URL"].endswith(":4222")  # the chart's client port


def test_the_nats_chart_values_make_a_three_node_jetstream_cluster_on_files_with_the_leafs_domain():
    config = nats_values()["config"]
    assert config["cluster"] == {"enabled": True, "replicas": 3}
    js = config["jetstream"]
    assert js["enabled"] and js["fileStore"]["enabled"] and not js["memoryStore"]["enabled"]
    leaf_conf = (ROOT / "infra" / "nats" / "leaf.conf").read_text()
    assert set(re.findall(r'"\$JS\.([A-Za-z0-9_-]+)\.API\.', leaf_conf)) == {js["merge"]["domain"]}
    assert config["leafnodes"]["enabled"] and config["monitor"]["enabled"]
    assert "jetstream" not in re.sub(r"#.*", "", leaf_conf)  # the leaf keeps no streams of its own


@functools.cache
def exported() -> dict[str, dict[str, set[str]]]:
    """What a worker's endpoint exports: sample name -> label name -> the values seen."""
    ctx = WorkerContext(
        nc=None,  # the collector reads counters only
        js=None,
        names=Names("default"),
        instance="i",
        model="m",
        policy=QueuePolicy(),
        counters=Counters(),
        errors=collections.Counter({str(ErrorCode.INTERNAL): 1}),
    )
    relay = KvEventRelay(ctx, {}, lambda: "serving")
    relay.running = True  # the relay's counters are exported while it runs
    registry = CollectorRegistry()
    registry.register(PlaneCollector(ctx, Slots(4), Lifecycle(RunningRequests(None)), relay))
    found: dict[str, dict[str, set[str]]] = collections.defaultdict(lambda: collections.defaultdict(set))
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            for label, value in sample.labels.items():
                found[sample.name][label].add(value)
    return found


def check_promql(expr: str) -> None:
    metrics = exported()
    used = set(re.findall(r"\bjetllm_[a-z_]+\b", expr))
    assert used and used <= metrics.keys(), f"{expr}: {sorted(used - metrics.keys())} not exported"
    for name, matchers in re.findall(r"\b(jetllm_[a-z_]+)\{([^}]*)\}", expr):
        for label, value in re.findall(r'(\w+)\s*(?:=~|!~|!=|=)\s*"([^"]*)"', matchers):
            assert label in metrics[name], f"{expr}: {name} has no label {label}"
            if label == "event":
                assert set(value.split("|")) <= metrics[name]["event"], f"{expr}: unknown event in {value}"
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        for label in (g.strip() for g in group.split(",")):
            assert all(label in metrics[m] for m in used), f"{expr}: not every metric has {label}"


def test_every_dashboard_panel_queries_metrics_the_worker_exports():
    text = (K8S / "monitoring" / "jetllm-dashboard.json").read_text()
    dashboard = json.loads(text)
    panels = dashboard["panels"]
    assert dashboard["uid"] and len({p["id"] for p in panels}) == len(panels) >= 8
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert 0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], p["title"]
        for target in p["targets"]:
            check_promql(target["expr"])
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "instance"):
        metric, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variables[name]["definition"]).groups()
        check_promql(metric)
        assert label in exported()[metric.split("{")[0]]
    configmap = only(render(K8S / "monitoring"), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["jetllm-dashboard.json"]) == dashboard
