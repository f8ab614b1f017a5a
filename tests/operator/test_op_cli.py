"""cli.py: kopf stopped by a transient API error (404 while a restarted API server syncs its CRDs,
5xx, 429, connection errors) is restarted in-process, a bounded number of times; anything else
exits 1 with a message. Every kopf start waits until discovery lists DwdpGroups (served.py; its own
tests run against the real API server in tests/k8s/test_k8s_served.py). Startup tunes the garbage
collector (gc_tuning)."""

import gc

import kopf
import pytest

from dwdp_operator import cli, gc_tuning, handlers, served


@pytest.fixture(autouse=True)
def _restore_gc():
    """cli.main tunes this process's collector: give the rest of the test session the defaults back."""
    saved = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)


class _Err(Exception):
    def __init__(self, status):
        super().__init__(f"{status} page not found")
        self.status = status


def _fake_run(monkeypatch, errors, waits=None):
    """kopf.run (and the discovery wait before it, which needs an API server) recorded: ``errors`` are
    raised by the next runs, ``waits`` (None, or a NotServed) by the next waits."""
    calls = []

    def run(**kw):
        calls.append(kw)
        if errors:
            raise errors.pop(0)

    def wait(api_client):
        calls.append("wait")
        if waits:
            raise waits.pop(0)
    monkeypatch.setattr(kopf, "run", run)
    monkeypatch.setattr(served, "wait_until_served", wait)
    monkeypatch.setattr(handlers, "kube_client", lambda: None)
    monkeypatch.setattr(cli, "RESTART_DELAY_S", 0.0)
    return calls


def _runs(calls):
    return [c for c in calls if c != "wait"]


def test_transient_404_restarts_kopf(monkeypatch):
    calls = _fake_run(monkeypatch, [_Err(404), ConnectionResetError("reset"), _Err(503)])
    assert cli.main(["-n", "x"]) == 0
    assert len(_runs(calls)) == 4
    assert calls[::2] == ["wait"] * 4, "every kopf start is preceded by the discovery wait"


def test_a_wait_that_ends_unserved_restarts_like_a_404_and_says_why(monkeypatch, caplog):
    calls = _fake_run(monkeypatch, [], waits=[served.NotServed("dwdpgroups.dwdp.io/v1alpha1 is not served")])
    assert cli.main([]) == 0
    assert calls[:2] == ["wait", "wait"] and len(_runs(calls)) == 1
    assert "is not served" in caplog.text


def test_restarts_are_bounded(monkeypatch, capsys):
    calls = _fake_run(monkeypatch, [_Err(404)] * 20)
    assert cli.main([]) == 1
    assert len(_runs(calls)) == cli.MAX_RESTARTS + 1
    assert "404" in capsys.readouterr().err


def test_restart_delays_double_up_to_the_cap_and_cover_minutes_of_outage(monkeypatch):
    monkeypatch.setattr(cli, "RESTART_DELAY_S", 1.0)
    delays = [cli.restart_delay(n) for n in range(1, cli.MAX_RESTARTS + 1)]
    assert delays[:3] == [1.0, 2.0, 4.0] and max(delays) == cli.RESTART_DELAY_CAP_S
    assert all(b >= a for a, b in zip(delays, delays[1:]))
    # an API server whose CRD handlers take a minute to sync after a restart must not exhaust the restarts
    assert sum(delays) >= 60 and sum(delays) < cli.RESTART_WINDOW_S


def test_the_loop_waits_the_backed_off_delay(monkeypatch):
    calls = _fake_run(monkeypatch, [_Err(404)] * 3)
    monkeypatch.setattr(cli, "RESTART_DELAY_S", 0.01)
    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    assert cli.main([]) == 0 and len(_runs(calls)) == 4
    assert slept == [0.01, 0.02, 0.04]


@pytest.mark.parametrize("err", [_Err(403), ValueError("bad config")])
def test_other_errors_exit_1(monkeypatch, capsys, err):
    calls = _fake_run(monkeypatch, [err])
    assert cli.main([]) == 1 and len(_runs(calls)) == 1
    assert "dwdp-operator:" in capsys.readouterr().err


@pytest.mark.parametrize("argv,literal", [(["-n", "demo"], True), (["-n", "a", "-n", "b"], True),
                                          (["-n", "team-*"], False), (["-n", "a", "-n", "b-*"], False), ([], False)])
def test_literal_namespaces_turn_discovery_off(monkeypatch, argv, literal):
    calls = _fake_run(monkeypatch, [])
    assert cli.main(argv) == 0
    assert _runs(calls)[0]["memo"].settings.literal_namespaces is literal


def test_each_kopf_restart_gets_a_fresh_memo(monkeypatch):
    calls = _fake_run(monkeypatch, [_Err(404)])
    assert cli.main(["--resync-seconds", "60"]) == 0
    runs = _runs(calls)
    assert runs[0]["memo"] is not runs[1]["memo"] and runs[1]["memo"].settings.resync_seconds == 60


def test_startup_freezes_the_heap_and_raises_the_gc_thresholds(monkeypatch):
    _fake_run(monkeypatch, [])
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert cli.main([]) == 0
    assert gc.get_threshold() == (gc_tuning.GEN0_THRESHOLD, gc_tuning.GEN1_THRESHOLD, gc_tuning.GEN2_THRESHOLD)
    assert gc.get_freeze_count() > 10_000  # kopf's, kubernetes' and pydantic's objects, out of every collection
