"""The docs say only what is there (issue #47, "docs that are true"):

* nothing in the repository refers to a file outside it (the material a developer reads beside the checkout is
  carried into docs/ in the project's own words, never cited);
* every repository path, Markdown link and ``dwdp_*`` module the user-facing docs name exists (a family of files
  may be named by its common prefix, e.g. ``docs/gpu-runs/2026-12-01-h200-k2-call{1,2}.log``);
* each worker folder's README names exactly its modules, and the kernels package's docstring names each kernel
  module.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: names of material outside the repository (written in pieces so this file does not name them itself)
OUTSIDE = [re.compile(p) for p in (r"\bHARDWARE" + r"\.md\b", r"\bDESIGN" + r"\.md\b", r"\bDESIGN" + r" §",
                                   r"\.\./" + r"shared\b", r"\bshared" + r"/(seed|k8s)\b")]
#: files that tell users how things are
USER_DOCS = [ROOT / "README.md", ROOT / "RELIABILITY.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "worker/dwdp_worker").rglob("README.md"))]
TOP_FOLDERS = ("operator", "worker", "dwdp_runtime", "docs", "tests", "scripts", "bench", "charts", "crds", "examples",
               ".ci")
#: paths the docs name that a run writes (they exist only after it)
GENERATED = (".ci/out/",)
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(re.escape(t) for t in TOP_FOLDERS) + r")/[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([^)#\s]+)")
MODULE = re.compile(r"`((?:dwdp_runtime|dwdp_worker|dwdp_operator)(?:\.\w+)+)")
PACKAGE_DIRS = {"dwdp_runtime": ROOT / "dwdp_runtime", "dwdp_worker": ROOT / "worker/dwdp_worker",
                "dwdp_operator": ROOT / "operator/dwdp_operator"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".patch", ""}


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if Path(n).suffix in TEXT_SUFFIXES and (ROOT / n).is_file()
            and not n.startswith("docs/gpu-runs/") and not n.startswith("docs/bench-runs/")]


def _exists(path: str) -> bool:
    """The path, or a family of files it names by prefix."""
    p = ROOT / path
    return p.exists() or (p.parent.is_dir() and any(c.name.startswith(p.name) for c in p.parent.iterdir()))


def _module_exists(dotted: str) -> bool:
    """``pkg.mod.sub`` is a module (file or package), or a module followed by a name its source defines."""
    parts = dotted.split(".")
    path, i = PACKAGE_DIRS[parts[0]], 1
    while i < len(parts) and ((path / parts[i]).is_dir() or (path / f"{parts[i]}.py").exists()):
        path = path / parts[i] if (path / parts[i]).is_dir() else path / f"{parts[i]}.py"
        i += 1
    if i == len(parts):
        return True
    source = path / "__init__.py" if path.is_dir() else path
    return source.exists() and re.search(rf"\b{re.escape(parts[i])}\b", source.read_text()) is not None


def test_nothing_refers_to_a_file_outside_the_repository():
    found = [f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for f in _tracked_text_files() if f != Path(__file__).resolve()
             for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
             if any(p.search(line) for p in OUTSIDE)]
    assert not found, "references to material outside the repository:\n" + "\n".join(found)


def test_every_path_link_and_module_the_docs_name_exists():
    missing = []
    for doc in USER_DOCS:
        text = doc.read_text()
        where = doc.relative_to(ROOT)
        for m in PATH.finditer(text):
            path = m.group(1).rstrip(".")
            if "*" in path or "<" in path or path.startswith(GENERATED):
                continue
            if not _exists(path):
                missing.append(f"{where}: path {path}")
        for m in LINK.finditer(text):
            target = m.group(1)
            if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists():
                missing.append(f"{where}: link {target}")
        for m in MODULE.finditer(text):
            if not _module_exists(m.group(1)):
                missing.append(f"{where}: module {m.group(1)}")
    assert not missing, "the docs name what does not exist:\n" + "\n".join(missing)


def test_each_worker_folder_readme_names_exactly_its_modules():
    wrong = []
    for readme in sorted((ROOT / "worker/dwdp_worker").rglob("README.md")):
        folder, text = readme.parent, readme.read_text()
        for module in sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__"):
            if not re.search(rf"`{module}(\.py)?`|`{module}`", text) and f"`{module}.py`" not in text:
                wrong.append(f"{readme.relative_to(ROOT)}: does not name {module}.py")
        for named in sorted(set(re.findall(r"`(\w+)\.py`", text))):
            if not (folder / f"{named}.py").exists() and not any(folder.rglob(f"{named}.py")):
                wrong.append(f"{readme.relative_to(ROOT)}: names {named}.py, which is not there")
    assert not wrong, "\n".join(wrong)


def test_the_kernels_package_names_each_kernel_module():
    import ast

    folder = ROOT / "dwdp_runtime/kernels"
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    named = set(re.findall(r"``(\w+)``", doc))
    unnamed = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__" and p.stem not in named)
    assert not unnamed, f"dwdp_runtime/kernels/__init__.py does not describe: {unnamed}"
