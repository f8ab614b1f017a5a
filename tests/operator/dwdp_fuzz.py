"""Hypothesis strategies for generated (mostly invalid) DwdpGroup specs, shared by the pure fuzz
tests (tests/operator/test_op_fuzz.py) and the bounded sample against the real API server
(tests/k8s/test_k8s_fuzz.py)."""

from __future__ import annotations

import copy
import string

from hypothesis import strategies as st

# every field already explicit, so server-side defaulting never changes what the operator sees
FULL_SPEC = {
    "numGroups": 1, "dwdpSize": 4, "gpusPerPod": 1, "image": "dwdp:test",
    "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4, "numPrefetchSlots": 2,
                "contentionOpt": True, "transfer": "copy_engine"},
    "model": {"synthetic": "qwen3_moe", "dtype": "bfloat16"},
    "imex": {"mode": "ComputeDomain"}, "topologyKey": "nvidia.com/gpu.clique",
    "restartPolicy": {"maxRestarts": 3, "backoffSeconds": 1}, "rollout": {"maxUnavailableGroups": 1},
    "httpPort": 8000, "storePort": 29500,
}
PATHS = [("numGroups",), ("dwdpSize",), ("gpusPerPod",), ("image",), ("experts", "numExperts"),
         ("experts", "numExpertsPerWorker"), ("experts", "numPrefetchExperts"), ("experts", "numPrefetchSlots"),
         ("experts", "contentionOpt"), ("experts", "transfer"), ("experts",), ("model", "synthetic"),
         ("model", "path"), ("model", "dtype"), ("model",), ("imex", "mode"), ("topologyKey",),
         ("restartPolicy", "maxRestarts"), ("restartPolicy", "backoffSeconds"), ("rollout", "maxUnavailableGroups"),
         ("httpPort",), ("storePort",), ("template", "env"), ("template", "nodeSelector"), ("resources",),
         ("sizing", "model"), ("sizing", "hardware"), ("sizing", "weightDtype")]
DELETE = object()
_text = st.text(alphabet=string.ascii_letters + string.digits + "-_./ ", max_size=12)
SMALL = st.integers(-3, 300)
SCALARS = st.one_of(st.none(), st.booleans(), SMALL, st.integers(-2**62, 2**62), _text,
                    st.sampled_from(["mixtral", "deepseek-r1", "h100-hgx", "nvlink", "None", "DWDP_SIZE", "float8"]))
ENVS = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["A", "DWDP_SIZE", "DWDP_X", "", "b"]),
                                       "value": _text}), max_size=2)
VALUES = st.one_of(SCALARS, SCALARS, st.lists(SMALL, max_size=3), st.dictionaries(_text, SMALL, max_size=2), ENVS)


def _set(spec: dict, path: tuple, value) -> None:
    cur = spec
    for k in path[:-1]:
        if not isinstance(cur.get(k), dict):
            cur[k] = {}
        cur = cur[k]
    if value is DELETE:
        cur.pop(path[-1], None)
    else:
        cur[path[-1]] = value


@st.composite
def specs(draw, *, allow_delete: bool = True, allow_unknown: bool = True, max_mutations: int = 4,
          well_typed: bool = False) -> dict:
    """A valid spec with 1..max_mutations fields set to generated values (or deleted / unknown keys).
    ``well_typed``: mostly small integers, which pass the CRD's OpenAPI types and so reach the
    operator's cross-field rules (no CEL on a 1.20 server)."""
    spec = copy.deepcopy(FULL_SPEC)
    paths = PATHS + ([("bogusField",), ("experts", "bogus")] if allow_unknown else [])
    values = st.one_of(SMALL, SMALL, SMALL, VALUES) if well_typed else VALUES
    values = st.one_of(values, st.just(DELETE)) if allow_delete else values
    for path, value in draw(st.lists(st.tuples(st.sampled_from(paths), values), min_size=1, max_size=max_mutations)):
        _set(spec, path, value)
    return spec


# anything JSON at all, as a spec (a broken client, a hand-edited object)
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(_text, inner, max_size=3)), max_leaves=8)
