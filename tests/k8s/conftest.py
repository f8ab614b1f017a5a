"""Session fixtures for the k8s suite: one real control plane, fake GPU nodes, the test kubelet, a
fake /healthz on 127.0.0.1 and the real ``dwdp-operator`` as a subprocess (restartable).

Binaries come from ``scripts/k8s-install.sh`` (``~/.cache/k8s-test/bin`` or ``$K8S_TEST_BIN``).
Missing binaries: the suite is skipped locally with the command to run, and FAILS when ``CI`` is set.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("K8S_TEST_BIN") or Path.home() / ".cache/k8s-test/bin")
NEEDED = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm")
NS_PREFIX = "dwdp-t-"


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.k8s)


#: operator log lines shown under a failed k8s test (the operator runs as a subprocess: its log is the
#: only record of why a group did not converge)
FAILURE_LOG_LINES = 150
#: lines left out of that excerpt: urllib3's per-attempt retry warnings (dozens per API-server restart)
LOG_NOISE = ("urllib3.connectionpool: Retrying",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("cluster")
    if rep.when != "call" or not rep.failed or cluster is None or cluster.operator is None:
        return
    try:
        lines = [ln for ln in cluster.operator.log().splitlines() if not any(n in ln for n in LOG_NOISE)]
    except OSError as e:
        lines = [f"(operator log unreadable: {e})"]
    rep.sections.append((f"operator log {cluster.operator.n}, last {FAILURE_LOG_LINES} lines",
                         "\n".join(lines[-FAILURE_LOG_LINES:])))


def _require_binaries() -> None:
    missing = [b for b in NEEDED if not (BIN / b).exists()]
    if missing:
        msg = (f"k8s test binaries missing in {BIN}: {', '.join(missing)}; "
               f"build them once with: bash scripts/k8s-install.sh (~10 min)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def wait_for(fn, *, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = fn()
        except Exception as e:  # noqa: BLE001 — keep polling through transient API errors
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def group_seen(c: "Cluster", ns: str, name: str) -> str:
    """One line of what a DwdpGroup and its pods look like now: the status's counts, then each live pod's
    phase, node and readiness (a wait that times out says this instead of "None")."""
    st = c.get_group(ns, name).get("status") or {}
    pods = c.live_pods(ns, f"dwdp.io/name={name}")

    def pod_line(p) -> str:
        conds = {x.type: x for x in (p.status.conditions or [])}
        line = f"{p.metadata.name}:{p.status.phase}@{p.spec.node_name or '-'}"
        if conds.get("Ready") is not None and conds["Ready"].status == "True":
            line += "+ready"
        if p.spec.scheduling_gates:
            line += "+gated"
        unscheduled = conds.get("PodScheduled")
        if unscheduled is not None and unscheduled.status == "False":
            line += f" ({unscheduled.reason}: {(unscheduled.message or '')[:120]})"
        return line
    return (f"readyGroups={st.get('readyGroups')} groups={len(st.get('groups') or [])} pods={len(pods)} "
            f"{sorted(pod_line(p) for p in pods)}")


def operator_said(op: "Operator") -> str:
    """Whether the operator process is alive, and its log's last lines (timestamped ones only)."""
    state = "running" if op.proc is not None and op.proc.poll() is None else f"exited {op.proc.returncode}"
    tail = "\n".join(line for line in op.log().splitlines()[-400:] if line[:4].isdigit())[-4000:]
    return f"operator {state}; its log's last lines:\n{tail}"


def wait_seen(c: "Cluster", ns: str, name: str, check, *, timeout: float, what: str,
              operator: "Operator | None" = None):
    """``wait_for(check)``; on a timeout the error also says what the group last looked like (``group_seen``)
    and what the operator was doing (``operator_said``)."""
    try:
        return wait_for(check, timeout=timeout, what=what)
    except AssertionError as e:
        try:
            seen = group_seen(c, ns, name)
        except Exception as read_error:  # noqa: BLE001 — the server may be away: say so, keep the timeout
            seen = f"(unreadable: {read_error})"
        unbound = "Pending@-" in seen  # a pod the scheduler has not placed: its log says why
        sched = f"\nkube-scheduler's last lines:\n{c.component_log('scheduler', 15)}" if unbound else ""
        raise AssertionError(f"{e}\nlast seen: {seen}\n{operator_said(operator or c.operator)}{sched}") from None


class Operator:
    """The real ``dwdp-operator`` console script as a subprocess."""

    def __init__(self, env: dict, log_dir: Path):
        self.env, self.log_dir, self.proc, self.n = env, log_dir, None, 0
        exe = Path(sys.executable).parent / "dwdp-operator"
        self.cmd = [str(exe) if exe.exists() else "dwdp-operator", "--namespace", f"{NS_PREFIX}*",
                    "--resync-seconds", "30", "--drain-seconds", "1", "--health-interval", "0.3"]

    def start(self) -> None:
        self.n += 1
        log = open(self.log_dir / f"operator-{self.n}.log", "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def kill(self) -> None:  # SIGKILL: no cleanup, like a crashed pod
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return (self.log_dir / f"operator-{self.n}.log").read_text()


class Cluster:
    def __init__(self, kubeconfig: str, tmp: Path, env: dict | None = None):
        from kubernetes import client, config
        self.kubeconfig, self.tmp, self.env = kubeconfig, tmp, env or {}
        self.audit_log = Path(self.env["AUDIT_LOG"]) if self.env.get("AUDIT_LOG") else None
        self.api = config.new_client_from_config(kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)
        self.net = client.NetworkingV1Api(self.api)
        self.kubelet = None
        self.health = None
        self.operator: Operator | None = None

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "kubectl"), "--kubeconfig", self.kubeconfig, *args],
                              capture_output=True, text=True, check=check, timeout=60)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = dict(os.environ, KUBECONFIG=self.kubeconfig, HELM_CACHE_HOME=str(self.tmp / "helm-cache"),
                   HELM_CONFIG_HOME=str(self.tmp / "helm-config"), HELM_DATA_HOME=str(self.tmp / "helm-data"))
        return subprocess.run([str(BIN / "helm"), *args], capture_output=True, text=True, check=check,
                              timeout=120, env=env)

    def component_log(self, name: str, lines: int) -> str:
        """The last ``lines`` lines of a control-plane component's log (``scripts/test-cluster``'s ``start``)."""
        try:
            return "\n".join((self.tmp / "state" / "run" / f"{name}.log").read_text().splitlines()[-lines:])
        except OSError as e:
            return f"(unreadable: {e})"

    def restart_apiserver(self) -> float:
        """SIGKILL kube-apiserver and start it again on the same etcd data (and a fresh kube-scheduler:
        ``scripts/test-cluster`` says why); seconds until both answer."""
        t0 = time.time()
        out = subprocess.run(["bash", str(ROOT / "scripts/test-cluster"), "restart-apiserver"], env=self.env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"restart-apiserver failed:\n{out.stdout}\n{out.stderr}"
        return time.time() - t0

    # -- DwdpGroup helpers ------------------------------------------------------------------
    def create_group(self, ns: str, body: dict) -> dict:
        return self.custom.create_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", body)

    def get_group(self, ns: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", name)

    def patch_spec(self, ns: str, name: str, spec: dict) -> dict:
        return self.custom.patch_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", name,
                                                          {"spec": spec})

    def pods(self, ns: str, selector: str = "dwdp.io/name") -> list:
        return self.core.list_namespaced_pod(ns, label_selector=selector).items

    def live_pods(self, ns: str, selector: str = "dwdp.io/name") -> list:
        return [p for p in self.pods(ns, selector) if not p.metadata.deletion_timestamp]

    def events(self, ns: str, reason: str | None = None) -> list:
        evs = self.core.list_namespaced_event(ns).items
        return [e for e in evs if reason is None or e.reason == reason]

    def condition(self, ns: str, name: str, ctype: str) -> dict | None:
        st = self.get_group(ns, name).get("status") or {}
        return next((c for c in st.get("conditions") or [] if c["type"] == ctype), None)


def group_body(name: str, **spec_over) -> dict:
    spec = {"numGroups": 2, "dwdpSize": 4, "image": "dwdp:test",
            "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4},
            "model": {"synthetic": "qwen3_moe"},
            "restartPolicy": {"maxRestarts": 3, "backoffSeconds": 1}}
    spec.update(spec_over)
    return {"apiVersion": "dwdp.io/v1alpha1", "kind": "DwdpGroup", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="session")
def cluster():
    _require_binaries()
    tmp = Path(tempfile.mkdtemp(prefix="dwdp-k8s-"))
    env = dict(os.environ, BIN=str(BIN), STATE=str(tmp / "state"),
               PRE_APPLY=f"{ROOT / 'crds/dwdpgroup.yaml'} {ROOT / 'tests/k8s/crds/computedomain.yaml'}",
               AUDIT_LOG=str(tmp / "audit.log"))  # service accounts only: the RBAC audit reads it
    for k, default in (("API_PORT", "16443"), ("ETCD_PORT", "12379"), ("ETCD_PEER", "12380"),
                       ("KCM_PORT", "12257"), ("SCHED_PORT", "12259")):
        env[k] = os.environ.get(f"DWDP_TEST_{k}", default)
    up = subprocess.run(["bash", str(ROOT / "scripts/test-cluster"), "up"], env=env, capture_output=True,
                        text=True, timeout=900)
    if up.returncode != 0:
        subprocess.run(["bash", str(ROOT / "scripts/test-cluster"), "down"], env=env, capture_output=True)
        pytest.fail(f"scripts/test-cluster up failed:\n{up.stdout}\n{up.stderr}")
    kubeconfig = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
    c = None
    try:  # from here on the control plane runs: whatever fails (a missing client package too) brings it down
        from .kubelet import HealthServer, Kubelet, make_nodes
        c = Cluster(kubeconfig, tmp, env)
        make_nodes(c.core)
        c.kubelet = Kubelet(c.api).start()
        c.health = HealthServer()
        op_env = dict(os.environ, KUBECONFIG=kubeconfig, DWDP_OPERATOR_HEALTH_URL=c.health.url_template)
        c.operator = Operator(op_env, tmp)
        c.operator.start()
        yield c
    finally:
        if c is not None:
            if c.operator:
                c.operator.stop()
                if os.environ.get("DWDP_TEST_KEEP_LOGS"):
                    print(f"operator logs in {tmp}", file=sys.stderr)
            if c.kubelet:
                c.kubelet.stop()
            if c.health:
                c.health.stop()
        subprocess.run(["bash", str(ROOT / "scripts/test-cluster"), "down"], env=env, capture_output=True)
        if not os.environ.get("DWDP_TEST_KEEP_LOGS"):
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def ns(cluster):
    op = cluster.operator
    if op is not None and op.proc is not None and op.proc.poll() is not None:
        # an earlier test left the operator dead (a fault test that failed between a kill and its restart, seen
        # once on CI after kopf hung stopping on a 404 during an API-server restart): start it again, so that
        # failure stays that test's instead of failing every later one
        op.start()
    name = f"{NS_PREFIX}{uuid.uuid4().hex[:6]}"
    cluster.core.create_namespace({"metadata": {"name": name}})
    yield name
    release_namespace(cluster, name)


#: how long a test's teardown waits for its namespace's pods to be gone (force-deleted: normally at once)
RELEASE_WAIT_S = 15.0


def release_namespace(cluster: "Cluster", name: str) -> None:
    """Delete a test's namespace and its pods now, so the next test starts on free GPUs.

    Why: the namespace controller removes a deleted namespace's pods seconds later, and until then they hold
    their nodes' GPUs. A next test's groups then competed with them: seen locally and on CI (2026-12-07), a
    group's first pod bound in a clique whose other nodes were full of the previous test's pods, a placement
    dead end the operator resolves only after ``restartPolicy.unschedulableSeconds`` (300 s). The namespace
    is deleted first (it refuses new content from then on: the operator cannot recreate a pod there), then its
    pods are force-deleted (grace 0, as the test kubelet confirms deletions anyway). (That they are gone from the
    scheduler too is the test scheduler's patch: ``scripts/k8s-patches``.)"""
    try:
        cluster.core.delete_namespace(name)
        cluster.core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
    except Exception:  # noqa: BLE001 — best effort: the namespace controller removes them anyway
        return
    def gone() -> bool:
        try:
            return not cluster.core.list_namespaced_pod(name).items
        except Exception as e:  # noqa: BLE001 — the namespace itself is gone (404): so are its pods
            if getattr(e, "status", None) == 404:
                return True
            raise

    try:
        wait_for(gone, timeout=RELEASE_WAIT_S, interval=0.1, what=f"namespace {name}'s pods gone")
    except AssertionError:
        pass  # the namespace controller removes them anyway
