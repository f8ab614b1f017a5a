"""Operator latency on the test API server (reports, never asserts).

  1. CR apply -> every pod created, for 8 groups x 4 pods (goal < 2 s);
  2. CR apply -> every group Ready (test kubelet marks bound pods Running/Ready);
  3. pod killed -> its whole group recreated (all 4 pods of attempt+1 exist, and Ready),
     with restartPolicy.backoffSeconds=0 so the number is the operator's own latency.
Starts its own control plane (scripts/test-cluster, ports 17443/13379/13380/21257/21259), the
test kubelet and the real dwdp-operator; stops all of it at the end.
    python bench/operator_latency.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/k8s"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dwdp-bench-"))
    env = dict(os.environ, STATE=str(tmp / "state"), API_PORT="17443", ETCD_PORT="13379", ETCD_PEER="13380",
               KCM_PORT="21257", SCHED_PORT="21259",
               PRE_APPLY=f"{ROOT / 'crds/dwdpgroup.yaml'} {ROOT / 'tests/k8s/crds/computedomain.yaml'}")
    up = subprocess.run(["bash", str(ROOT / "scripts/test-cluster"), "up"], env=env, capture_output=True, text=True)
    if up.returncode:
        print(f"test-cluster up failed: {up.stderr.strip()}", file=sys.stderr)
        return 1
    kubeconfig = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
    from kubernetes import client, config
    from kubelet import HealthServer, Kubelet, make_nodes
    api = config.new_client_from_config(kubeconfig)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    make_nodes(core, cliques=8, per_clique=4)
    kubelet = Kubelet(api).start()
    health = HealthServer()
    exe = Path(sys.executable).parent / "dwdp-operator"
    op = subprocess.Popen([str(exe) if exe.exists() else "dwdp-operator", "--resync-seconds", "5"],
                          env=dict(os.environ, KUBECONFIG=kubeconfig, DWDP_OPERATOR_HEALTH_URL=health.url_template),
                          stdout=open(tmp / "operator.log", "w"), stderr=subprocess.STDOUT)
    create, ready, recreate, recreate_ready = [], [], [], []
    try:
        time.sleep(3)
        for r in range(args.repeats):
            ns = f"bench-{r}"
            core.create_namespace({"metadata": {"name": ns}})
            body = {"apiVersion": "dwdp.io/v1alpha1", "kind": "DwdpGroup", "metadata": {"name": "b"},
                    "spec": {"numGroups": 8, "dwdpSize": 4, "image": "dwdp:bench",
                             "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4},
                             "model": {"synthetic": "qwen3_moe"},
                             "restartPolicy": {"maxRestarts": 5, "backoffSeconds": 0}}}
            t0 = time.perf_counter()
            custom.create_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", body)
            while len(core.list_namespaced_pod(ns).items) < 32:
                time.sleep(0.005)
            create.append(time.perf_counter() - t0)
            while (custom.get_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", "b")
                   .get("status", {}).get("readyGroups")) != 8:
                time.sleep(0.01)
            ready.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            core.delete_namespaced_pod("b-g3-p1", ns)

            def group3():
                return [p for p in core.list_namespaced_pod(ns, label_selector="dwdp.io/group=3").items
                        if not p.metadata.deletion_timestamp and p.metadata.labels["dwdp.io/attempt"] == "1"]
            while len(group3()) < 4:
                time.sleep(0.005)
            recreate.append(time.perf_counter() - t0)
            while (custom.get_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", "b")
                   .get("status", {}).get("readyGroups")) != 8:
                time.sleep(0.01)
            recreate_ready.append(time.perf_counter() - t0)
    finally:
        op.terminate()
        op.wait(10)
        kubelet.stop()
        health.stop()
        subprocess.run(["bash", str(ROOT / "scripts/test-cluster"), "down"], env=env, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)

    def fmt(xs):
        return f"median {statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"
    print("operator latency on the test API server (kube-apiserver 1.20 + etcd, 2 cores)")
    print(f"  CR apply -> 32 pods created (8 groups x 4): {fmt(create)}   goal < 2 s")
    print(f"  CR apply -> 8 groups Ready:                 {fmt(ready)}")
    print(f"  pod killed -> group's 4 pods recreated:     {fmt(recreate)}   (backoffSeconds=0)")
    print(f"  pod killed -> group Ready again:            {fmt(recreate_ready)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
