"""A bounded sample (15, derandomized) of generated invalid DwdpGroup specs against the real API
server and the running operator: every case is refused with a 4xx carrying a message, or stored
and marked Invalid=True by the operator with a message (a case the server itself turns valid, e.g. a
null pruned then defaulted, is counted apart and deleted); no child is created for any of them and
the operator neither crashes nor logs a failed reconcile."""

from __future__ import annotations

import json
import uuid

from hypothesis import HealthCheck, assume, given, settings
from dwdp_operator.spec import validate_spec
from kubernetes.client.rest import ApiException

from tests.timing import hold
from ..operator.dwdp_fuzz import specs
from .conftest import release_namespace, wait_for

N = 15


def test_generated_invalid_specs_refused_or_marked_invalid(cluster):
    c = cluster
    ns = f"dwdp-t-fz{uuid.uuid4().hex[:5]}"
    c.core.create_namespace({"metadata": {"name": ns}})
    refused: dict[str, str] = {}
    stored: dict[str, dict] = {}
    normalized: list[str] = []
    log_before = len(c.operator.log())

    # no deletes / unknown keys: the server would default or prune them into another spec
    @settings(max_examples=N, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(specs(allow_delete=False, allow_unknown=False, max_mutations=3, well_typed=True))
    def submit(spec):
        assume(validate_spec(spec))  # invalid by the operator's own rules
        name = f"fz-{len(refused) + len(stored)}"
        body = {"apiVersion": "dwdp.io/v1alpha1", "kind": "DwdpGroup", "metadata": {"name": name}, "spec": spec}
        try:
            c.create_group(ns, body)
            kept = c.get_group(ns, name)["spec"]
            if validate_spec(kept):
                stored[name] = spec
            else:  # the server pruned a null / defaulted a field into a valid spec: not a bad input any more
                normalized.append(name)
                c.custom.delete_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", name)
        except ApiException as e:
            assert 400 <= e.status < 500, (spec, e.status, e.body)
            msg = json.loads(e.body).get("message", "") if e.body else ""
            assert msg, (spec, e.body)
            refused[name] = msg
        except ValueError:  # the client refuses to serialize it (e.g. out of int64): never sent
            refused[f"client-{len(refused)}"] = "not serializable"

    try:
        submit()
        assert len(refused) + len(stored) + len(normalized) >= N - 2, "hypothesis ran the bounded sample"
        for name, spec in stored.items():
            cond = wait_for(lambda: (x := c.condition(ns, name, "Invalid")) and x["status"] == "True" and x,
                            timeout=30, what=f"{name} marked Invalid ({spec})")
            assert cond["message"].startswith("spec"), (name, cond)
        hold(1.5, "a window in which no child may appear for an invalid spec")
        owners = {p.metadata.labels.get("dwdp.io/name") for p in c.pods(ns)}
        owners |= {(x.metadata.labels or {}).get("dwdp.io/name") for x in c.core.list_namespaced_service(ns).items}
        assert not owners & set(stored), "no child for an invalid spec"
        assert c.operator.proc.poll() is None
        log = "\n".join(x for x in c.operator.log()[log_before:].splitlines() if f"{ns}/" in x or "Traceback" in x)
        assert "Traceback" not in log and " failed: " not in log, log[-3000:]
        print(f"\nFIGURE fuzz-k8s: {len(refused) + len(stored)} generated invalid specs: {len(refused)} refused "
              f"(4xx), {len(stored)} marked Invalid, {len(normalized)} made valid by server pruning/defaults; 0 crashes")
    finally:
        release_namespace(c, ns)
