"""The Dockerfile parses: stages, non-root users, entrypoints that are declared console scripts,
no downloads at build time beyond package installs (no Docker engine here: a static check)."""

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def instructions():
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def stages():
    cur, res = None, {}
    for op, rest in instructions():
        if op == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)$", rest, re.I)
            assert m, f"every stage is named: FROM {rest}"
            cur = m.group(2)
            res[cur] = [("FROM", m.group(1))]
        elif cur:
            res[cur].append((op, rest))
    return res


def test_stages_and_targets():
    assert list(stages()) == ["build", "operator", "worker"]


def test_entrypoints_are_console_scripts_and_users_non_root():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for target, script in (("operator", "dwdp-operator"), ("worker", "dwdp-worker")):
        ins = stages()[target]
        entry = [json.loads(r) for o, r in ins if o == "ENTRYPOINT"]
        assert entry == [[script]] and script in scripts
        users = [r for o, r in ins if o == "USER"]
        assert users and not users[-1].split(":")[0] in ("0", "root")
    worker_cmd = [json.loads(r) for o, r in stages()["worker"] if o == "CMD"]
    assert worker_cmd == [["pod"]]  # dwdp-worker pod, as the operator runs it


def test_no_downloads_beyond_package_installs():
    for op, rest in instructions():
        assert not (op == "ADD" and re.search(r"https?://", rest)), rest
        if op == "RUN":
            assert not re.search(r"\b(curl|wget)\b", rest), rest


def test_copied_paths_exist_and_extras_are_declared():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for op, rest in instructions():
        if op == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists() or src == "README.md", src
        for listed in re.findall(r"\.whl\)\[([\w,-]+)\]", rest):
            for extra in listed.split(","):
                assert extra in extras, extra
