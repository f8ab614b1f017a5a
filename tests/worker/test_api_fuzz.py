"""Fuzz ``POST /v1/completions`` of one live server (real local launcher, 1 group × 2 ranks) with
hypothesis: bodies generated from the OpenAPI schema the server itself serves (``/openapi.json``),
mixed with junk values, unknown fields, huge numbers, NaN/Infinity, unicode (lone surrogates too),
deep nesting, raw bytes and odd content types.

Every case must be answered 2xx or 4xx (never 5xx, never a dropped connection); every 4xx carries an
OpenAI-style error with a message; after the fuzz a known request returns the oracle's answer.
Then schemathesis checks the server against its own OpenAPI document (every status, content type and
header a route returns is documented; 405 with ``Allow``; no 5xx), ``CONTRACT_CASES`` per operation.
Bounded: ``CASES`` generated cases plus a fixed list of nasty bodies, well under a minute.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .serving_helpers import Server, greedy_reference

CASES = 300
CONTRACT_CASES = 40
tried = {"n": 0, "by_status": {}, "contract": 0}


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(["--local", "--model", str(model_dir), "--dwdp-size", "2", "--backend", "host",
                  "--max-num-tokens", "64", "--served-model-name", "tiny"])
    try:
        srv.wait_for("/readyz", timeout_s=120)
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def schema(server):
    spec = server.get("/openapi.json").json()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = body["$ref"].rsplit("/", 1)[-1]
    return spec["components"]["schemas"][name]


def _check(server: Server, *, content: bytes, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type is not None else {}
    try:
        r = server.http.post("/v1/completions", content=content, headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        raise AssertionError(f"the server dropped the connection ({exc!r}) on {content[:300]!r}") from None
    tried["n"] += 1
    tried["by_status"][r.status_code] = tried["by_status"].get(r.status_code, 0) + 1
    assert r.status_code < 500, (r.status_code, r.text[:500], content[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"].strip(), r.text
        assert "Traceback" not in err["message"]
    elif r.headers.get("content-type", "").startswith("text/event-stream"):  # stream: true
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text[-500:]
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events and all("error" not in e or e["error"]["type"] != "server_error" for e in events), r.text[-500:]
    else:
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert choices and all(isinstance(c["token_ids"], list) for c in choices), r.text


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
TOKEN_IDS = st.lists(st.integers(min_value=-5, max_value=300) | st.integers(min_value=-(2**70), max_value=2**70),
                     max_size=80)
TEXT = st.text(max_size=200) | st.sampled_from(["", " ", "\ud800", "\udfff hi", "\x00", "é" * 500, "🦄" * 40])


def _value_for(prop: dict):
    """A value that follows the property's schema (roughly), or junk."""
    types = {s.get("type") for s in prop.get("anyOf", [prop])}
    options = [JUNK]
    if "integer" in types:
        options.append(st.integers(min_value=-3, max_value=70) | st.integers(min_value=2**31, max_value=2**70))
    if "number" in types:
        options.append(st.floats(allow_nan=True, allow_infinity=True) | st.just(0))
    if "string" in types:
        options.append(TEXT)
    if "boolean" in types:
        options.append(st.booleans())
    if "array" in types:
        options.append(TOKEN_IDS)
    typed = st.one_of(*options[1:]) if options[1:] else JUNK
    if "default" in prop:  # the schema's default is valid: draw it often so bodies also reach admission
        typed = st.just(prop["default"]) | st.just(prop["default"]) | typed
    return st.integers(0, 5).flatmap(lambda i: JUNK if i == 0 else typed)  # mostly well-typed, sometimes junk


@st.composite
def _bodies(draw, schema: dict):
    props = schema["properties"]
    body = {}
    for name, prop in props.items():
        if name in schema.get("required", []) or draw(st.booleans()):
            if draw(st.integers(0, 9)):  # mostly present
                body[name] = draw(_value_for(prop))
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=10))] = draw(JUNK)
    return body


NASTY = [
    (b"", "application/json"), (b"{", "application/json"), (b"null", "application/json"),
    (b"[]", "application/json"), (b'"prompt"', "application/json"), (b"\xff\xfe\x00", "application/json"),
    (b'{"prompt": [1, 2, 3]}', "text/plain"), (b'{"prompt": [1, 2, 3]}', None),
    (b"prompt=1", "application/x-www-form-urlencoded"), (b'{"prompt": [1]}', "multipart/form-data"),
    (b'{"prompt": [1]}', "application/json; charset=latin-1"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),
    (b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "application/json"),
    (b'{"prompt": [1e999]}', "application/json"), (b'{"prompt": [NaN]}', "application/json"),
    (b'{"prompt": "a", "temperature": NaN}', "application/json"),
    (b'{"prompt": [1], "max_tokens": 1e400}', "application/json"),
    (b'{"prompt": [1], "max_tokens": 99999999999999999999999999999}', "application/json"),
    (b'{"prompt": [' + b"1," * 20000 + b'1]}', "application/json"),
    (json.dumps({"prompt": "\ud800\udc00\ud800"}).encode(), "application/json"),
    (b'{"prompt": "\\ud800"}', "application/json"), (b'{"prompt": "\\u0000"}', "application/json"),
    (b'{"prompt": [1], "prompt": "x"}', "application/json"),
    (json.dumps({"prompt": "x" * 200_000}).encode(), "application/json"),
]


def test_nasty_bodies_are_4xx_with_a_message(server):
    for content, ctype in NASTY:
        _check(server, content=content, content_type=ctype)


def test_generated_bodies_from_the_openapi_schema(server, schema):
    assert "prompt" in schema["properties"] and "max_tokens" in schema["properties"]

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=_bodies(schema), ctype=st.sampled_from(["application/json"] * 6 + ["application/json; charset=utf-8",
                                                                                     "text/plain", "", None]))
    def run(body, ctype):
        content = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        _check(server, content=content, content_type=ctype)

    run()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


contract = schemathesis.pytest.from_fixture("api_schema")


@contract.parametrize()
@settings(max_examples=CONTRACT_CASES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_the_server_keeps_its_openapi_contract(case):
    # Schema-valid is not always servable: the model's limits (vocabulary, context length, text length) are
    # not in the schema and are a documented 400, so "valid data is accepted" does not hold by design.
    case.call_and_validate(timeout=30, excluded_checks=[schemathesis.checks.positive_data_acceptance])
    tried["contract"] += 1


def test_after_the_fuzz_a_known_request_gets_the_oracle_answer(server, model_dir):
    want, _, _ = greedy_reference(model_dir, [5, 17, 42, 99, 3], 3)
    r = server.post({"prompt": [5, 17, 42, 99, 3], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert server.get("/healthz").status_code == 200 and server.proc.poll() is None
    print(f"\nfuzz: {tried['n']} bad/odd inputs tried, by status {dict(sorted(tried['by_status'].items()))}; "
          f"OpenAPI contract: {tried['contract']} schemathesis cases")
    assert tried["n"] >= CASES  # the fuzz tests above ran in this module
