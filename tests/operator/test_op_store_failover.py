"""The operator's side of an elastic group's store failover (experts.replicas > 1): every rank hosts a standby store
on ``contract.standby_store_port(storePort, rank)``. The pods learn where every pod answers
(``DWDP_POD_ADDR_TEMPLATE``), the NetworkPolicy opens storePort .. storePort + dwdpSize to the DwdpGroup's own
workers, and validation (operator and CEL alike) keeps those ports inside TCP's range and apart from httpPort and
the KV handoff's ports. A group that is not elastic renders exactly as before."""

import pytest

from dwdp_operator import manifests as M
from dwdp_operator.spec import DwdpGroupSpec, validate_spec
from dwdp_runtime.contract import ElasticEnv, LayoutEnv, standby_store_port

from .dwdp_op_util import spec
from .test_op_crd import cel_errors
from .test_op_manifests import contract_names

ELASTIC = {"replicas": 2}
OWN = {"dwdp.io/name": "r1", "app.kubernetes.io/component": "worker"}


def elastic(**over) -> dict:
    return spec(experts=ELASTIC, **over)


def env_of(raw: dict, *, g: int = 1, i: int = 2) -> dict[str, str | None]:
    pod = M.worker_pod(name="r1", ns="ns", uid="u", g=g, i=i, attempt=0, spec=DwdpGroupSpec.model_validate(raw),
                       thash="h")
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_only_an_elastic_pod_gets_the_pod_address_template_after_the_contract():
    assert list(env_of(spec())) == contract_names()  # not elastic: the contract, nothing more
    assert list(env_of(elastic())) == contract_names() + [LayoutEnv.EXPERT_REPLICAS, ElasticEnv.POD_ADDR_TEMPLATE]


@pytest.mark.parametrize("g", [0, 3])
def test_the_template_names_every_pod_of_the_group_as_the_store_address_names_pod_0(g):
    env = env_of(elastic(), g=g, i=1)
    template = env[ElasticEnv.POD_ADDR_TEMPLATE]
    assert template == f"r1-g{g}-p{{pod}}.r1-ranks.ns.svc" and template.count("{pod}") == 1
    assert template.replace("{pod}", "0") == env["DWDP_STORE_ADDR"]  # one formula for both
    sp = DwdpGroupSpec.model_validate(elastic())
    for i in range(sp.pods_per_group):  # each pod's DNS name under the rank Service: hostname.subdomain
        pod = M.worker_pod(name="r1", ns="ns", uid="u", g=g, i=i, attempt=0, spec=sp, thash="h")
        assert template.replace("{pod}", str(i)) == f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}.ns.svc"


def test_the_store_failover_changes_no_template_hash():
    """The hashes at e66c7bc (before the failover's env): an operator upgrade rolls no group, elastic or not."""
    assert M.template_hash(DwdpGroupSpec.model_validate(spec())) == "47fa95af00"
    assert M.template_hash(DwdpGroupSpec.model_validate(elastic())) == "90b075f369"


def test_network_policy_opens_every_standby_store_port_to_the_groups_own_workers_only():
    sp = DwdpGroupSpec.model_validate(elastic(httpPort=8100, storePort=29600))
    stores, http = M.network_policy(name="r1", ns="ns", uid="u", spec=sp)["spec"]["ingress"]
    assert stores == {"ports": [{"protocol": "TCP", "port": 29600, "endPort": 29604}],
                      "from": [{"podSelector": {"matchLabels": OWN}}]}
    port = stores["ports"][0]
    assert all(port["port"] < standby_store_port(29600, rank) <= port["endPort"] for rank in range(sp.dwdpSize))
    assert http == {"ports": [{"protocol": "TCP", "port": 8100}]}
    plain = DwdpGroupSpec.model_validate(spec(storePort=29600))
    assert M.network_policy(name="r1", ns="ns", uid="u", spec=plain)["spec"]["ingress"][0]["ports"] == \
        [{"protocol": "TCP", "port": 29600}]  # not elastic: storePort alone, no endPort


def test_store_ports_are_the_store_and_every_ranks_standby():
    sp = DwdpGroupSpec.model_validate(elastic(storePort=1000))
    assert sp.elastic and sp.store_ports == (1000, standby_store_port(1000, sp.dwdpSize - 1)) == (1000, 1004)
    plain = DwdpGroupSpec.model_validate(spec(storePort=1000))
    assert not plain.elastic and plain.store_ports == (1000, 1000)


# (spec, a piece of the operator's message, or "" = valid); CEL must agree on every one
CASES = {
    "store-range-at-the-top": (elastic(storePort=65531), ""),
    "store-range-past-65535": (elastic(storePort=65532), "spec.storePort=65532: an elastic group (experts.replicas=2 > 1) "
                               "serves rendezvous stores on ports 65532-65536"),
    "store-range-past-65535-fix": (elastic(storePort=65532), "set storePort to 65531 or less"),
    "not-elastic-at-the-top": (spec(storePort=65535), ""),
    "http-just-below": (elastic(httpPort=29499), ""),
    "http-first-standby": (elastic(httpPort=29501), "spec.httpPort=29501"),
    "http-last-standby": (elastic(httpPort=29504), "set httpPort below 29500 or above 29504"),
    "http-just-above": (elastic(httpPort=29505), ""),
    "not-elastic-http-next-to-store": (spec(httpPort=29501), ""),
    "kv-just-below": (elastic(kvTransfer={"budgetBytes": 0, "tcpPortBase": 29436}), ""),
    "kv-last-port-on-store": (elastic(kvTransfer={"budgetBytes": 0, "tcpPortBase": 29437}),
                              "spec.kvTransfer.tcpPortBase=29437: the KV handoff's ports 29437-29500 overlap"),
    "kv-first-port-on-last-standby": (elastic(kvTransfer={"budgetBytes": 0, "tcpPortBase": 29504}),
                                      "set tcpPortBase above 29504 or to 29436 or less"),
    "kv-just-above": (elastic(kvTransfer={"budgetBytes": 0, "tcpPortBase": 29505}), ""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_elastic_port_rules_refuse_with_the_fix_and_cel_agrees(case):
    raw, needle = CASES[case]
    errors = validate_spec(raw)
    if needle:
        assert any(needle in e for e in errors), errors
    else:
        assert errors == []
    assert bool(cel_errors(raw)) == bool(errors), (cel_errors(raw), errors)
