"""KV settings from flags and env; KV metrics and the /healthz budget summary from rank stats."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dwdp_worker.kv.metrics import KvCollector, budget_summary
from dwdp_worker.kv.options import add_kv_arguments, settings_from_args, settings_from_env
from dwdp_worker.kv.region import KvRegion
from dwdp_worker.kv.store import KvStore


def parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_kv_arguments(p)
    return p


def test_flags_take_units_and_default_off():
    assert not settings_from_args(parser().parse_args([])).enabled
    s = settings_from_args(parser().parse_args(["--kv-budget-bytes", "2GiB", "--kv-block-bytes", "64KiB",
                                                "--kv-ttl-s", "5"]))
    assert (s.budget_bytes, s.block_bytes, s.ttl_s, s.enabled) == (2 << 30, 64 << 10, 5.0, True)
    with pytest.raises(argparse.ArgumentError, match="not a size"):
        parser().parse_args(["--kv-budget-bytes", "lots"])
    with pytest.raises(ValueError, match="multiple of 64"):
        settings_from_args(parser().parse_args(["--kv-block-bytes", "100"]))
    with pytest.raises(ValueError, match="smaller than one block"):
        settings_from_args(parser().parse_args(["--kv-budget-bytes", "1KiB"]))
    assert settings_from_args(parser().parse_args(["--kv-grace-s", "0"])).grace_s == 0
    with pytest.raises(ValueError, match="grace period must be >= 0"):
        settings_from_args(parser().parse_args(["--kv-grace-s", "-1"]))


def test_env_names_the_bad_variable():
    from dwdp_runtime.contract import KvEnv

    s = settings_from_env({KvEnv.BUDGET_BYTES: "1048576", KvEnv.BLOCK_BYTES: "4096", KvEnv.TTL_S: "2.5",
                           KvEnv.LEASE_S: "9", KvEnv.UCX_TCP_PORT_RANGE: "30000-30063"})
    assert (s.budget_bytes, s.block_bytes, s.ttl_s, s.lease_s) == (1 << 20, 4096, 2.5, 9.0)
    assert not settings_from_env({}).enabled
    with pytest.raises(ValueError, match="DWDP_KV_TTL_S='soon'"):
        settings_from_env({KvEnv.TTL_S: "soon"})


@pytest.mark.parametrize("explicit,pod_ip,bind,route,expected", [
    ("ctx-0.example.svc", "10.1.2.3", "0.0.0.0", "192.168.0.9", "ctx-0.example.svc"),  # explicit wins
    (None, "10.1.2.3", "127.0.0.1", "192.168.0.9", "127.0.0.1"),    # one bound address: the only one answering
    (None, "10.1.2.3", "0.0.0.0", "192.168.0.9", "10.1.2.3"),       # a pod: its IP
    (None, "fd00::7", "::", None, "fd00::7"),
    (None, None, "0.0.0.0", "192.168.0.9", "192.168.0.9"),          # no pod: this host's outgoing address
    (None, None, "10.0.0.5", None, "10.0.0.5"),
])
def test_the_advertised_kv_host(explicit, pod_ip, bind, route, expected):
    from dwdp_worker.kv.address import advertise_host

    assert advertise_host(explicit=explicit, pod_ip=pod_ip, bind_host=bind, route=lambda: route) == expected


@pytest.mark.parametrize("explicit,bind,needle", [
    ("0.0.0.0", "127.0.0.1", "is a wildcard"),
    ("http://ctx:8000", "127.0.0.1", "neither an IP address nor a host name"),
    (None, "0.0.0.0", "set --kv-advertise-host"),                  # wildcard, no pod IP, no route: refused
])
def test_no_wildcard_is_ever_advertised(explicit, bind, needle):
    from dwdp_worker.kv.address import AdvertiseError, advertise_host

    with pytest.raises(AdvertiseError, match=needle):
        advertise_host(explicit=explicit, pod_ip=None, bind_host=bind, route=lambda: None)


def test_the_real_outgoing_address_is_no_wildcard_and_flag_beats_env():
    import ipaddress

    from dwdp_worker.kv.address import route_address
    from dwdp_worker.kv.options import advertise_host_for

    found = route_address()
    assert found is None or not (ipaddress.ip_address(found).is_unspecified or ipaddress.ip_address(found).is_loopback)
    p = parser()
    p.add_argument("--host", default="0.0.0.0")
    env = {"DWDP_KV_ADVERTISE_HOST": "from-env.example", "DWDP_POD_IP": "10.9.8.7"}
    assert advertise_host_for(p.parse_args([]), env) == "from-env.example"
    assert advertise_host_for(p.parse_args(["--kv-advertise-host", "flag.example"]), env) == "flag.example"
    assert advertise_host_for(p.parse_args([]), {"DWDP_POD_IP": "10.9.8.7"}) == "10.9.8.7"


def test_operator_renders_kv_env_the_worker_parses_and_opens_the_ucx_ports():
    from dwdp_operator import manifests as M
    from dwdp_operator.spec import DwdpGroupSpec, validate_spec
    from dwdp_runtime.contract import KvEnv

    from ..operator.dwdp_op_util import spec

    def env(sp):
        return {e["name"]: e.get("value") for e in M.worker_env(name="r", ns="n", g=0, i=0, attempt=0, spec=sp)}

    plain = DwdpGroupSpec.model_validate(spec())
    kv = DwdpGroupSpec.model_validate(spec(kvTransfer={"budgetBytes": 8 << 30, "ttlSeconds": 5}))
    assert not {k for k in env(plain) if k.startswith("DWDP_KV") or k.startswith("UCX")}
    s = settings_from_env(env(kv))
    assert (s.budget_bytes, s.block_bytes, s.ttl_s, s.lease_s) == (8 << 30, 1 << 20, 5.0, 30.0)
    assert env(kv)["UCX_TCP_PORT_RANGE"] == "30000-30063"
    # the pod IP (the KV responses' remote_host) comes from the downward API, never a literal
    rendered = M.worker_env(name="r", ns="n", g=0, i=0, attempt=0, spec=kv)
    pod_ip = [e for e in rendered if e["name"] == "DWDP_POD_IP"]
    assert pod_ip == [{"name": "DWDP_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert [e["name"] for e in rendered][-6:] == [v.value for v in KvEnv]     # in the contract's order
    pod = M.worker_pod(name="r", ns="n", uid="u", g=0, i=0, attempt=0, spec=kv, thash="h")
    assert pod_ip[0] in pod["spec"]["containers"][0]["env"]
    assert "DWDP_POD_IP" not in env(plain)
    rules = M.network_policy(name="r", ns="n", uid="u", spec=kv)["spec"]["ingress"]
    assert {"protocol": "TCP", "port": 30000, "endPort": 30063} in [p for r in rules for p in r["ports"]]
    assert len(M.network_policy(name="r", ns="n", uid="u", spec=plain)["spec"]["ingress"]) == 2
    # an absent section leaves existing groups' pods alone; setting it rolls them
    assert M.template_hash(plain) == M.template_hash(DwdpGroupSpec.model_validate(spec()))
    assert M.template_hash(plain) != M.template_hash(kv)
    assert validate_spec(spec(kvTransfer={"budgetBytes": 1, "blockBytes": 100}))


def test_metrics_and_budget_summary_are_what_the_ranks_reported():
    import torch

    store = KvStore(KvRegion(8 * 1024, block_bytes=1024))
    store.put("a", [(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))], 4)
    store.put("b", [(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))], 4)
    store.claim("b", "dec", "n")
    assert store.confirm("b", "dec", "n").valid
    assert not store.confirm("b", "dec", "n").valid          # a second confirmation: stale
    # as the front's snapshot shows them (rank_handle.snapshot: RankStats.kv as a dict, None without a budget)
    ranks = [{"global_id": 0, "kv": store.stats().as_dict()}, {"global_id": 1, "kv": None}]
    summary = budget_summary(ranks)
    assert summary == {"budget_bytes": 8192, "held_bytes": 1024, "use": 0.125, "held_sequences": 1,
                       "pulls": 1, "expirations": 0, "stale": 1}
    assert budget_summary([{"global_id": 0, "kv": None}]) is None
    reg = CollectorRegistry()
    reg.register(KvCollector(lambda: {"ranks": ranks}))
    text = generate_latest(reg).decode()
    assert 'dwdp_kv_held_bytes{rank="0"} 1024.0' in text
    assert 'dwdp_kv_pulls_total{rank="0"} 1.0' in text
    assert 'dwdp_kv_budget_bytes{rank="0"} 8192.0' in text
    assert 'dwdp_kv_stale_total{rank="0"} 1.0' in text and 'dwdp_kv_quarantined_bytes{rank="0"} 0.0' in text
    assert 'rank="1"' not in text
