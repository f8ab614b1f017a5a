"""Generated specs through the pure core (hypothesis, thousands of cases, well under 20 s):
  * ``validate_spec`` never raises and returns messages (non-empty strings) or [];
  * ``desired_state`` never raises; an invalid spec gives a status-only plan (no child created or
    deleted, condition Invalid=True whose message carries every validation message, one Warning
    event); a valid spec gives consistent children (numGroups x podsPerGroup pods named and labelled
    by group and index, env matching the spec, the client and rank Services and one NetworkPolicy per DwdpGroup, the token only
    by reference, every child owned by the DwdpGroup).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dwdp_operator.desired import desired_state
from dwdp_operator.spec import DwdpGroupSpec, validate_spec
from .dwdp_fuzz import ANY_JSON, specs
from .dwdp_op_util import cr

FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T0 = 1_700_000_000.0


@FUZZ
@given(st.one_of(specs(), ANY_JSON))
def test_validate_spec_never_raises(raw):
    msgs = validate_spec(raw if isinstance(raw, dict) else raw)
    assert isinstance(msgs, list) and all(isinstance(m, str) and m for m in msgs)


@FUZZ
@given(specs())
def test_desired_state_invalid_means_messages_valid_means_consistent_children(raw):
    msgs = validate_spec(raw)
    num = raw.get("numGroups")
    if not msgs and isinstance(num, int) and num > 40:
        raw = {**raw, "numGroups": 40}  # keep a valid plan small; validity does not depend on it
        msgs = validate_spec(raw)
    plan = desired_state(cr(raw), [], now=T0, token="tok-secret-123")
    if msgs:
        assert not plan.valid and not plan.creates and not plan.deletes and not plan.patches
        cond = next(c for c in plan.status["conditions"] if c["type"] == "Invalid")
        assert cond["status"] == "True"
        for m in msgs:
            assert m in cond["message"]
        assert [e[:2] for e in plan.events] == [("Warning", "InvalidSpec")]
        return
    assert plan.valid
    spec = DwdpGroupSpec.model_validate(raw).model_dump()  # with the defaults the operator applies
    per = spec["dwdpSize"] // spec["gpusPerPod"]
    pods = [m for m in plan.creates if m["kind"] == "Pod"]
    assert sorted(p["metadata"]["name"] for p in pods) == sorted(
        f"r1-g{g}-p{i}" for g in range(spec["numGroups"]) for i in range(per))
    for p in pods:
        lab = p["metadata"]["labels"]
        g, i = lab["dwdp.io/group"], lab["dwdp.io/pod-index"]
        assert p["metadata"]["name"] == f"r1-g{g}-p{i}"
        env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
        assert env["DWDP_SIZE"] == str(spec["dwdpSize"]) and env["DWDP_GROUP"] == g
        assert env["DWDP_RANK_BASE"] == str(int(i) * spec["gpusPerPod"])
        assert env["DWDP_TOKEN"] is None and "tok-secret-123" not in str(p)
    for kind, want in (("Service", ["r1", "r1-ranks"]), ("NetworkPolicy", ["r1"])):  # per DwdpGroup, any numGroups
        assert sorted(m["metadata"]["name"] for m in plan.creates if m["kind"] == kind) == want, kind
    for m in plan.creates:
        assert [o["uid"] for o in m["metadata"]["ownerReferences"]] == ["uid-1"]
