"""What a reconcile pass reads: the newest copy of the DwdpGroup (no GET when kopf's event or the
operator's own status write already gave it) and the wait for the pods it wrote (expectations)."""

from dwdp_operator.expectations import PodExpectation
from dwdp_operator.reconciler import _KeyState


def _pod(name, deleting=False):
    return {"name": name, "deleting": deleting}


def test_a_pass_waits_for_its_created_pods_then_goes():
    exp = PodExpectation.after(["a", "b"], [], now=100.0, wait_s=5.0)
    assert exp.wait([_pod("a")], now=100.5) == 4.5  # b's ADDED event is not in yet
    assert exp.wait([_pod("a"), _pod("b")], now=100.6) is None


def test_a_pass_waits_until_rolled_back_pods_are_gone():
    exp = PodExpectation.after(["a", "b"], ["b"], now=0.0, wait_s=5.0)
    assert exp.present == {"a"} and exp.absent == {"b"}
    assert exp.wait([_pod("a"), _pod("b")], now=1.0) == 4.0
    assert exp.wait([_pod("a"), _pod("b", deleting=True)], now=1.0) is None  # being deleted counts as gone


def test_the_wait_is_bounded_and_nothing_to_wait_for_is_none():
    exp = PodExpectation.after(["a"], [], now=0.0, wait_s=5.0)
    assert exp.wait([], now=5.0) is None  # an event that never comes does not stall the group
    assert PodExpectation.after([], [], now=0.0, wait_s=5.0) is None


def _body(rv, phase):
    return {"metadata": {"name": "g", "resourceVersion": rv}, "status": {"phase": phase}}


def test_the_newest_copy_wins_whatever_order_it_arrives_in():
    st = _KeyState()
    st.keep(_body("10", "written"))   # our own status write's answer
    st.keep(_body("9", "older event"))  # kopf's event for an earlier change, delivered late
    assert st.body["status"]["phase"] == "written"
    st.keep(_body("12", "user edit"))
    assert st.body["status"]["phase"] == "user edit"
    st.keep(None)
    assert st.body["status"]["phase"] == "user edit"


def test_a_copy_without_a_numeric_version_is_never_cached():
    st = _KeyState()
    st.keep({"metadata": {"name": "g", "resourceVersion": "opaque-x"}})
    assert st.body is None  # the pass GETs
