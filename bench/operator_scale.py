"""Operator scale on the test API server (reports, never asserts): N DwdpGroups applied at once.

For each N (default 50, 200, 500) on a fresh control plane (scripts/test-cluster, ports
18443/14379/14380/22257/22259; no nodes, so pods stay Pending — the operator's own cost, not a kubelet's):
  1. raw: the API server's own create rate for the same pods, measured first in the same run: the
     operator's pod manifests for the N groups written to one file and created by ``kubectl create -f``
     (one client, sequential, as a user would), and by 8 such kubectl processes at once (the
     operator's own write parallelism), with the operator not running;
  2. operator: N DwdpGroups created at once (8 client threads); seconds until every one of their
     pods exists (a watch counts ADDED), pods/s, and the operator's CPU during it;
  3. idle: the operator's CPU (% of one core) and RSS over ``--idle-seconds`` (60) once creation is
     done and the operator has drained its event backlog (the first 5 s window under 5 % of a core). The operator runs with ``--resync-seconds 60``, so the window holds about one safety
     resync of every object (the default, 300 s, resyncs 5x less often).
    python bench/operator_scale.py [--sizes 50,200,500] [--groups 2] [--idle-seconds 60] [--repeats 1]

``--groups G`` gives every DwdpGroup G groups (``numGroups``; default 2, the shape issue 19 measured): the
DwdpGroup's own children (Secret, client and rank Services, NetworkPolicy, ComputeDomain, status, Event) are then shared by 4·G pods.
Run it alone (it takes the machine): e.g. ``flock /tmp/dwdp-k8s.lock python bench/operator_scale.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("K8S_TEST_BIN") or Path.home() / ".cache/k8s-test/bin")
PORTS = {"API_PORT": "18443", "ETCD_PORT": "14379", "ETCD_PEER": "14380", "KCM_PORT": "22257", "SCHED_PORT": "22259"}
PODS_PER_GROUP = 4      # dwdpSize 4, one GPU per pod; numGroups groups per DwdpGroup (--groups, default 2)
RAW_PARALLEL = 8        # the operator's apply pool size (apply.Applier parallel)
CREATE_THREADS = 8      # clients creating the DwdpGroups
RESYNC_S = 60           # so the idle window holds about one safety resync per object
SETTLE_S = 5            # after the last pod: idle starts at the first 5 s window under SETTLED_CPU
SETTLED_CPU = 0.05      # fraction of a core
SETTLE_MAX_S = 300


def group_body(i: int, groups: int) -> dict:
    return {"apiVersion": "dwdp.io/v1alpha1", "kind": "DwdpGroup", "metadata": {"name": f"s{i}"},
            "spec": {"numGroups": groups, "dwdpSize": PODS_PER_GROUP, "image": "dwdp:bench",
                     "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4},
                     "model": {"synthetic": "qwen3_moe"}}}


def raw_pod_manifests(n: int, ns: str, groups: int) -> list[dict]:
    """The operator's own pod manifests for n DwdpGroups, relabelled so the operator never indexes them."""
    from dwdp_operator import manifests as M
    from dwdp_operator.spec import DwdpGroupSpec

    out = []
    for i in range(n):
        body = group_body(i, groups)
        spec = DwdpGroupSpec.model_validate(body["spec"])
        for g in range(groups):
            for p in range(PODS_PER_GROUP):
                m = M.worker_pod(name=f"s{i}", ns=ns, uid="raw", g=g, i=p, attempt=0, spec=spec, thash="raw")
                m["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "bench-raw"
                m["metadata"].pop("ownerReferences")
                out.append(m)
    return out


def kubectl(kubeconfig: str, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([str(BIN / "kubectl"), "--kubeconfig", kubeconfig, *args], capture_output=True, text=True,
                         timeout=1200)
    if out.returncode:
        raise RuntimeError(f"kubectl {' '.join(args[:2])} failed: {out.stderr.strip()[-1500:]}")
    return out


def raw_rates(kubeconfig: str, core, n: int, groups: int, tmp: Path) -> tuple[float, float]:
    """(pods/s, one kubectl), (pods/s, RAW_PARALLEL kubectls) for the same n groups' pods."""
    rates = []
    for tag, procs in (("seq", 1), ("par", RAW_PARALLEL)):
        ns = f"raw-{tag}"
        core.create_namespace({"metadata": {"name": ns}})
        pods = raw_pod_manifests(n, ns, groups)
        files = []
        for k in range(procs):
            f = tmp / f"raw-{tag}-{k}.yaml"
            f.write_text(yaml.safe_dump_all(pods[k::procs]))
            files.append(f)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(procs) as pool:
            list(pool.map(lambda f: kubectl(kubeconfig, "create", "--validate=false", "-f", str(f), "-o", "name"), files))
        rates.append(len(pods) / (time.perf_counter() - t0))
    return rates[0], rates[1]


class PodCounter:
    """Counts ADDED pods of the operator in ``ns`` through one watch (no polling load on the server)."""

    def __init__(self, api, ns: str):
        from kubernetes import client, watch
        self.count, self.last, self._stopped = 0, 0.0, False
        self._w = watch.Watch()
        core = client.CoreV1Api(api)

        def run():
            try:
                for ev in self._w.stream(core.list_namespaced_pod, ns, timeout_seconds=3600,
                                         label_selector="app.kubernetes.io/managed-by=dwdp-operator"):
                    if ev["type"] == "ADDED":
                        self.count += 1
                        self.last = time.perf_counter()
            except Exception:  # noqa: BLE001 — stop() ends the stream mid-chunk
                if not self._stopped:
                    raise
        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()

    def stop(self) -> None:
        self._stopped = True
        self._w.stop()


def request_counts(kubeconfig: str) -> dict[str, float]:
    """The API server's own request counters (``apiserver_request_total``) as "VERB resource" -> count."""
    text = kubectl(kubeconfig, "get", "--raw", "/metrics").stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        key = f"{labels.get('verb', '?')} {labels.get('resource', '?')}{'/' + labels['subresource'] if labels.get('subresource') else ''}"
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def requests_per_group(before: dict, after: dict, n: int) -> dict[str, float]:
    """Requests per DwdpGroup during the operator phase, excluding watches and the bench's own creates."""
    out = {}
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if k == "POST dwdpgroups":
            d -= n  # the bench's own creates
        if d > 0 and not k.startswith("WATCH"):
            out[k] = round(d / n, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def one_size(n: int, groups: int, idle_s: float, tmp: Path) -> dict:
    """One round at size n on a fresh control plane: raw rates, operator creation, then ``idle_s`` of idle."""
    env = dict(os.environ, BIN=str(BIN), STATE=str(tmp / f"state-{n}"), **PORTS,
               PRE_APPLY=f"{ROOT / 'crds/dwdpgroup.yaml'} {ROOT / 'tests/k8s/crds/computedomain.yaml'}")
    up = subprocess.run(["bash", str(ROOT / "scripts/test-cluster"), "up"], env=env, capture_output=True, text=True)
    if up.returncode:
        raise RuntimeError(f"test-cluster up failed: {up.stderr.strip()[-2000:]}")
    kubeconfig = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
    # no scheduler: with no node it would write an Unschedulable status (and retry) for every pod of both
    # phases, a load that depends on what the other phase left behind; the operator's cost is the point here
    sched = tmp / f"state-{n}" / "run" / "scheduler.pid"
    if sched.exists():
        subprocess.run(["kill", sched.read_text().strip()], capture_output=True)
    from kubernetes import client, config
    api = config.new_client_from_config(kubeconfig)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    op = None
    try:
        raw_seq, raw_par = raw_rates(kubeconfig, core, n, groups, tmp)
        ns = "scale"
        core.create_namespace({"metadata": {"name": ns}})
        exe = Path(sys.executable).parent / "dwdp-operator"
        cmd = [str(exe) if exe.exists() else "dwdp-operator"]
        if os.environ.get("DWDP_BENCH_PROFILE"):  # a cProfile of the operator, for finding its hot spots
            cmd = [sys.executable, "-m", "cProfile", "-o", os.environ["DWDP_BENCH_PROFILE"], "-m", "dwdp_operator.cli"]
        op = subprocess.Popen([*cmd, "--resync-seconds", str(RESYNC_S)],
                              env=dict(os.environ, KUBECONFIG=kubeconfig), stdout=open(tmp / f"operator-{n}.log", "w"),
                              stderr=subprocess.STDOUT)
        proc = psutil.Process(op.pid)
        time.sleep(4)  # kopf started and watching
        counter = PodCounter(api, ns)
        want = n * groups * PODS_PER_GROUP
        req0 = request_counts(kubeconfig)
        cpu0, t0 = cpu_s(proc), time.perf_counter()
        with ThreadPoolExecutor(CREATE_THREADS) as pool:
            list(pool.map(lambda i: custom.create_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups",
                                                                           group_body(i, groups)), range(n)))
        applied = time.perf_counter() - t0
        while counter.count < want and time.perf_counter() - t0 < 1800:
            time.sleep(0.05)
        all_pods = counter.last - t0
        create_cpu = cpu_s(proc) - cpu0
        counter.stop()
        settle_t0 = time.perf_counter()
        while time.perf_counter() - settle_t0 < SETTLE_MAX_S:  # the operator drains its event backlog first
            c0 = cpu_s(proc)
            time.sleep(SETTLE_S)
            if (cpu_s(proc) - c0) / SETTLE_S < SETTLED_CPU:
                break
        settled = time.perf_counter() - settle_t0
        per_group = requests_per_group(req0, request_counts(kubeconfig), n)  # every write creation caused, settled
        cpu1, t1 = cpu_s(proc), time.perf_counter()
        rss_peak = proc.memory_info().rss
        while time.perf_counter() - t1 < idle_s:
            rss_peak = max(rss_peak, proc.memory_info().rss)
            time.sleep(1)
        idle_pct = 100 * (cpu_s(proc) - cpu1) / (time.perf_counter() - t1) if idle_s > 0 else None
        return {"n": n, "groups_per_dwdpgroup": groups, "pods": want, "pods_seen": counter.count, "apply_s": round(applied, 2),
                "all_pods_s": round(all_pods, 2), "pods_per_s": round(want / all_pods, 1),
                "raw_kubectl_pods_per_s": round(raw_seq, 1), f"raw_kubectl_x{RAW_PARALLEL}_pods_per_s": round(raw_par, 1),
                "ratio_vs_kubectl": round(want / all_pods / raw_seq, 2),
                f"ratio_vs_kubectl_x{RAW_PARALLEL}": round(want / all_pods / raw_par, 2),
                "operator_cpu_s_during_create": round(create_cpu, 1), "settle_s": round(settled, 1),
                "idle_cpu_pct_of_core": None if idle_pct is None else round(idle_pct, 2), "idle_rss_mib": round(rss_peak / 2**20, 1),
                "requests_per_group": round(sum(per_group.values()), 1), "requests_per_group_by_kind": per_group,
                "load_average": [round(x, 2) for x in os.getloadavg()]}
    finally:
        if op is not None:
            op.terminate()
            try:
                op.wait(15)
            except subprocess.TimeoutExpired:
                op.kill()
        subprocess.run(["bash", str(ROOT / "scripts/test-cluster"), "down"], env=env, capture_output=True)
        shutil.rmtree(tmp / f"state-{n}", ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="50,200,500", help="DwdpGroup counts, comma-separated (default 50,200,500)")
    ap.add_argument("--groups", type=int, default=2,
                    help="numGroups of every DwdpGroup (default 2, issue 19's measurement; 1 is the worst case: the "
                         "DwdpGroup's own children are shared by 4 pods only)")
    ap.add_argument("--idle-seconds", type=float, default=60.0, help="idle CPU/RSS window (default 60)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds per size, each on a fresh control plane (the idle window in the first only); the "
                         "table shows the median ratio and the range — on a shared machine one round moves by "
                         "+-0.2 (default 1)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the operator logs (the folder is printed)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dwdp-scale-"))
    if args.keep_logs:
        print(f"operator logs in {tmp}", file=sys.stderr)
    rows = []
    try:
        for n in [int(x) for x in args.sizes.split(",")]:
            rounds = []
            for k in range(max(1, args.repeats)):
                rounds.append(one_size(n, args.groups, args.idle_seconds if k == 0 else 0.0, tmp))
                print(json.dumps({**rounds[-1], "round": k}), flush=True)
            rows.append(summarize_rounds(rounds))
    finally:
        if not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\noperator scale on the test API server (kube-apiserver 1.20 + etcd, {psutil.cpu_count()} cores, "
          f"{args.groups} × {PODS_PER_GROUP} pods per DwdpGroup, --resync-seconds {RESYNC_S})")
    print(f"{'N':>5} {'pods':>6} {'rounds':>6} {'all pods s':>10} {'pods/s':>7} {'kubectl/s':>9} {'x8/s':>7} "
          f"{'ratio (range)':>17} {'ratio x8 (range)':>17} {'idle %core':>10} {'RSS MiB':>8}")
    for r in rows:
        print(f"{r['n']:>5} {r['pods']:>6} {r['rounds']:>6} {r['all_pods_s']:>10} {r['pods_per_s']:>7} "
              f"{r['raw_kubectl_pods_per_s']:>9} {r[f'raw_kubectl_x{RAW_PARALLEL}_pods_per_s']:>7} "
              f"{_ranged(r, 'ratio_vs_kubectl'):>17} {_ranged(r, f'ratio_vs_kubectl_x{RAW_PARALLEL}'):>17} "
              f"{r['idle_cpu_pct_of_core']:>10} {r['idle_rss_mib']:>8}")
    return 0


def summarize_rounds(rounds: list[dict]) -> dict:
    """One row per size: the medians of the rounds' rates and ratios, the ratios' ranges, the first round's idle."""
    import statistics

    med = {k: round(statistics.median(r[k] for r in rounds), 2) for k in (
        "all_pods_s", "pods_per_s", "raw_kubectl_pods_per_s", f"raw_kubectl_x{RAW_PARALLEL}_pods_per_s",
        "ratio_vs_kubectl", f"ratio_vs_kubectl_x{RAW_PARALLEL}")}
    ranges = {f"{k}_range": (min(r[k] for r in rounds), max(r[k] for r in rounds))
              for k in ("ratio_vs_kubectl", f"ratio_vs_kubectl_x{RAW_PARALLEL}")}
    return {**rounds[0], **med, **ranges, "rounds": len(rounds)}


def _ranged(row: dict, key: str) -> str:
    lo, hi = row[f"{key}_range"]
    return f"{row[key]}" if lo == hi else f"{row[key]} ({lo}-{hi})"


if __name__ == "__main__":
    sys.exit(main())
