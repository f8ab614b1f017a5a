"""spec.kernelCache: the workers' kernel compile caches on a volume that outlives the pod (issue #34, cold start)."""

from __future__ import annotations

import celpy
import pytest

from dwdp_operator import manifests as M
from dwdp_operator.crdgen import openapi_schema
from dwdp_operator.spec import KERNEL_CACHE_PATH, KERNEL_CACHE_VOLUME, DwdpGroupSpec, validate_spec

from .dwdp_op_util import spec

KC_SCHEMA = openapi_schema()["properties"]["spec"]["properties"]["kernelCache"]
_ENV = celpy.Environment()
RULES = [(_ENV.program(_ENV.compile(r["rule"])), r["message"]) for r in KC_SCHEMA["x-kubernetes-validations"]]


def _cel_errors(kc: dict) -> list[str]:
    return [m for prog, m in RULES if not bool(prog.evaluate({"self": celpy.json_to_cel(kc)}))]


def _pod(**over):
    sp = DwdpGroupSpec.model_validate(spec(**over))
    return M.worker_pod(name="r1", ns="ns", uid="u", g=0, i=0, attempt=0, spec=sp, thash=M.template_hash(sp))


@pytest.mark.parametrize("source, volume", [
    ({"claimName": "dwdp-kernels"}, {"persistentVolumeClaim": {"claimName": "dwdp-kernels"}}),
    ({"hostPath": "/var/lib/dwdp/kernels"}, {"hostPath": {"path": "/var/lib/dwdp/kernels",
                                                          "type": "DirectoryOrCreate"}}),
])
def test_the_volume_is_mounted_and_named_by_the_compile_cache_variable(source, volume):
    pod = _pod(kernelCache=source)
    container = pod["spec"]["containers"][0]
    assert {"name": KERNEL_CACHE_VOLUME, **volume} in pod["spec"]["volumes"]
    assert {"name": KERNEL_CACHE_VOLUME, "mountPath": KERNEL_CACHE_PATH} in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DWDP_COMPILE_CACHE_DIR"] == KERNEL_CACHE_PATH
    assert validate_spec(spec(kernelCache=source)) == [] and _cel_errors(source) == []


def test_without_it_nothing_changes_and_the_hash_is_the_old_one():
    plain = DwdpGroupSpec.model_validate(spec())
    pod = _pod()
    assert all(v["name"] != KERNEL_CACHE_VOLUME for v in pod["spec"]["volumes"])
    assert "DWDP_COMPILE_CACHE_DIR" not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    with_cache = DwdpGroupSpec.model_validate(spec(kernelCache={"claimName": "c"}))
    assert M.template_hash(plain) != M.template_hash(with_cache)  # adding one rolls the groups
    assert "kernelCache" not in plain.model_dump(exclude_none=True)


@pytest.mark.parametrize("source", [{}, {"claimName": "c", "hostPath": "/x"}])
def test_exactly_one_source_by_the_operator_and_by_cel(source):
    errors = validate_spec(spec(kernelCache=source))
    assert any("exactly one of claimName" in e for e in errors), errors
    assert _cel_errors(source) and _cel_errors(source)[0] in errors[0]


@pytest.mark.parametrize("template, needle", [
    ({"env": [{"name": "DWDP_COMPILE_CACHE_DIR", "value": "/other"}]}, "set from spec.kernelCache"),
    ({"volumes": [{"name": KERNEL_CACHE_VOLUME, "emptyDir": {}}]}, "rename the volume"),
    ({"volumeMounts": [{"name": "m", "mountPath": KERNEL_CACHE_PATH}]}, "use another path"),
])
def test_the_template_cannot_take_its_variable_volume_or_path(template, needle):
    errors = validate_spec(spec(kernelCache={"claimName": "c"}, template=template))
    assert any(needle in e for e in errors), errors
    assert validate_spec(spec(template=template)) == []  # without spec.kernelCache they are the user's own


def test_a_relative_host_path_is_refused_by_the_schema():
    assert validate_spec(spec(kernelCache={"hostPath": "cache"}))
