"""Strict checks of Kubernetes manifests without a server, for the tests of what we ship.

* ``model_errors(obj)``: the object read into the ``kubernetes`` client's model of its kind and
  written back (``ApiClient().sanitize_for_serialization``); any key the model drops, or value it
  changes, is an error. The client's models silently ignore unknown keys, so the round trip is what
  makes them strict. A CRD's JSON schema nodes are checked one by one the same way: the model keeps
  ``items`` and ``additionalProperties`` as raw dicts, which would hide a bad key below an array.
* ``instance_errors(openapi, obj)``: ``obj`` against a CRD's structural schema with JSON Schema
  draft 4 (OpenAPI 3.0's boolean ``exclusiveMinimum``), where every object that lists its
  properties refuses any other key: the field the API server would prune without a word.
* ``custom_resource_errors(openapi, obj)``: both, for a custom resource (metadata by the model).
* ``helm()``: the helm binary the k8s suite uses (``scripts/k8s-install.sh``); missing, the caller
  is skipped locally with the command to run, and fails when ``CI`` is set (as in tests/k8s).
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
from kubernetes import client

K8S_BIN = Path(os.environ.get("K8S_TEST_BIN") or Path.home() / ".cache/k8s-test/bin")
SCHEMA_CHILDREN = ("properties", "items", "additionalProperties")


def model_class_name(obj: dict) -> str:
    """``apps/v1`` ``Deployment`` -> ``V1Deployment`` (the client's naming)."""
    version = obj["apiVersion"].rsplit("/", 1)[-1]
    return version[0].upper() + version[1:] + obj["kind"]


def has_model(obj: dict) -> bool:
    return hasattr(client, model_class_name(obj))


def _diff(sent: Any, back: Any, path: str) -> list[str]:
    if isinstance(sent, dict) and isinstance(back, dict):
        out = [f"{path}.{k}: unknown key (dropped by the model)" for k in sent if k not in back]
        out += [f"{path}.{k}: added {back[k]!r} by the model" for k in back if k not in sent]
        return out + [e for k in sent if k in back for e in _diff(sent[k], back[k], f"{path}.{k}")]
    if isinstance(sent, list) and isinstance(back, list) and len(sent) == len(back):
        return [e for i, (a, b) in enumerate(zip(sent, back)) for e in _diff(a, b, f"{path}[{i}]")]
    if sent != back or type(sent) is not type(back):
        return [f"{path}: {sent!r} became {back!r}"]
    return []


def roundtrip_errors(obj: dict, model: str, path: str = "") -> list[str]:
    try:
        parsed = getattr(client, model).from_dict(obj)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        return [f"{path or '<root>'}: {model} refuses it: {' '.join(str(e).split())[:300]}"]
    return _diff(obj, client.ApiClient().sanitize_for_serialization(parsed), path)


def schema_nodes(schema: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    """Every JSON schema node below (and with) ``schema``."""
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, dict):
            yield from schema_nodes(sub, f"{path}.properties.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from schema_nodes(schema[key], f"{path}.{key}")


def model_errors(obj: dict) -> list[str]:
    """What the client's model of ``obj``'s kind does not take as written (``[]``: all of it)."""
    errors = roundtrip_errors(obj, model_class_name(obj))
    if obj.get("kind") == "CustomResourceDefinition":
        for i, version in enumerate(obj["spec"]["versions"]):
            root = ((version.get("schema") or {}).get("openAPIV3Schema")) or {}
            for path, node in schema_nodes(root, f".spec.versions[{i}].schema.openAPIV3Schema"):
                alone = {k: v for k, v in node.items() if k not in SCHEMA_CHILDREN}
                errors += roundtrip_errors(alone, "V1JSONSchemaProps", path)
    return list(dict.fromkeys(errors))  # a node below ``properties`` is read by both checks


def strict_json_schema(openapi: dict) -> dict:
    """A CRD's structural schema as draft-4 JSON Schema that refuses what the server would prune."""
    out = copy.deepcopy(openapi)
    for _, node in schema_nodes(out):
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    return out


def instance_errors(openapi: dict, obj: Any) -> list[str]:
    validator = jsonschema.Draft4Validator(strict_json_schema(openapi))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]


def custom_resource_errors(openapi: dict, obj: dict) -> list[str]:
    """A custom resource: its metadata by the client's model, the rest by the CRD's schema (which,
    like every CRD's, leaves apiVersion, kind and metadata to the API server)."""
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    return roundtrip_errors(obj.get("metadata") or {}, "V1ObjectMeta", ".metadata") + instance_errors(openapi, body)


def helm() -> str:
    found = K8S_BIN / "helm"
    path = str(found) if found.exists() else shutil.which("helm")
    if path is None:
        msg = f"helm missing in {K8S_BIN} and on PATH; install it once with: bash scripts/k8s-install.sh"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path
