"""No dangling path in README.md, docs/*.md or a module docstring; one line per module in
docs/structure.md, in its folder's group.

A path is checked when it has this repository's shape: it starts with one of the top folders
(``mambacache/...``, ``docs/...md``, ``configs/...toml``, ``tests/...py``, ...) and must exist
from the root; it starts with one of their subfolders (``engine/overlap.py``, ``tpu/ssd.py``) and
must exist under some top folder; or it is a bare ``name.py`` / ``name.toml`` and some file of
the repository has that name. ``<placeholder>`` and ``*`` are globs that must match something.
Left alone: URLs, other projects' paths (a first folder that is not ours, such as sglang's
``python/sglang/...``, or a name right after the project's, as in "SGLang's ``x.py``"), and bare
data file names (``r.json``, ``chat.jsonl``). Also checked: ``python -m`` modules of this
repository and ``tests/x.py::name`` node ids. Host only; reads files, imports nothing.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("mambacache", "models", "pallas_kernels", "scripts", "tests", "docs", "configs",
               "examples")
DOCSTRING_FOLDERS = ("mambacache", "models", "pallas_kernels", "scripts", "examples")
# docs/structure.md's groups, in order; a file belongs to the longest group that prefixes it.
STRUCTURE_GROUPS = (
    "mambacache/", "mambacache/config/", "mambacache/cache/", "mambacache/engine/",
    "mambacache/engine/leases/", "mambacache/engine/step/", "mambacache/engine/speculative/",
    "mambacache/engine/sampling/", "mambacache/engine/runners/", "mambacache/engine/shadow/",
    "mambacache/parallel/",
    "mambacache/serve/", "mambacache/bench/", "models/", "pallas_kernels/",
    "pallas_kernels/tpu/", "pallas_kernels/gpu/", "pallas_kernels/reference/",
    "pallas_kernels/aot/", "scripts/", "examples/", "docs/",
)
_SEG = r"[\w<>*-][\w.<>*-]*"
_EXT = r"(?:py|md|toml|sh|json|jsonl|txt|yaml|cfg)"
PATH_RE = re.compile(
    rf"(?<![\w./:<>*-])((?:{_SEG}/)+(?:{_SEG}\.{_EXT})?|[\w<>*-]+\.(?:py|toml))(?![\w/<>*-])")
URL_RE = re.compile(r"\b\w+://\S+")
EXTERNAL_RE = re.compile(
    r"(?i)\b(?:sglang|vllm|nano-vllm|mini-sglang|fla|flash-linear-attention|transformers|jax|"
    r"gemma|maxtext|triton|orbax|flax|torch|pytorch|tokenizers)(?:'s)?[\s:,(`]*$")
MODULE_RE = re.compile(r"python3? -m ([\w.]+)")
NODE_RE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


@functools.cache
def repo_paths(root: Path = ROOT) -> set[str]:
    """Every file and folder (with a trailing ``/``) under the top folders, plus root files."""
    out = {p.name for p in root.iterdir() if p.is_file()}
    for top in TOP_FOLDERS:
        for p in [root / top, *(root / top).rglob("*")]:
            if "__pycache__" in p.parts or not p.exists():
                continue
            rel = p.relative_to(root).as_posix()
            out.add(rel + "/" if p.is_dir() else rel)
    return out


@functools.cache
def tracked_files(root: Path = ROOT) -> set[str]:
    """The files git tracks (a module another engineer is still writing does not count yet);
    every file when this is not a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                             check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return {p for p in repo_paths(root) if not p.endswith("/")}
    return {p for p in out.split("\0") if p and (root / p).is_file()}


def _subfolders(paths: set[str]) -> set[str]:
    return {part for p in paths for part in p.rstrip("/").split("/")[1:-1]} | {
        p.rstrip("/").split("/")[-1] for p in paths if p.endswith("/") and "/" in p.rstrip("/")}


def dangling(text: str, paths: set[str]) -> list[str]:
    """The repository-shaped paths in ``text`` that match nothing in ``paths``."""
    text = URL_RE.sub(" ", text)
    subfolders = _subfolders(paths)
    basenames = {p.rstrip("/").rsplit("/", 1)[-1] for p in paths}
    missing = []
    for m in PATH_RE.finditer(text):
        ref = m.group(1)
        pattern = re.sub(r"<[^>/]*>", "*", ref)
        first = ref.split("/", 1)[0]
        if "/" not in ref:
            found = any(fnmatch.fnmatchcase(b, pattern) for b in basenames)
        elif first in TOP_FOLDERS:
            found = any(fnmatch.fnmatchcase(p, pattern) for p in paths)
        elif first in subfolders:
            found = any(fnmatch.fnmatchcase(p, "*/" + pattern) for p in paths)
        else:
            continue  # another project's path
        if not found and not EXTERNAL_RE.search(text[max(0, m.start() - 40):m.start()]):
            missing.append(ref)
    return missing


def missing_modules(text: str, paths: set[str]) -> list[str]:
    """``python -m`` modules of this repository that have no file."""
    out = []
    for mod in MODULE_RE.findall(text):
        stem = mod.replace(".", "/")
        if mod.split(".")[0] in DOCSTRING_FOLDERS and not {
                stem + ".py", stem + "/__main__.py"} & paths:
            out.append(mod)
    return out


@functools.cache
def documents(root: Path = ROOT) -> dict[str, str]:
    """README.md, docs/*.md and the docstring of every tracked module, by path."""
    docs = {p.relative_to(root).as_posix(): p.read_text()
            for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]}
    for rel in sorted(tracked_files(root)):
        if rel.split("/", 1)[0] in DOCSTRING_FOLDERS and rel.endswith(".py"):
            doc = ast.get_docstring(ast.parse((root / rel).read_text()), clean=False)
            if doc:
                docs[rel] = doc
    return docs


def structure_errors(text: str, modules: list[str]) -> list[str]:
    """docs/structure.md: groups in order, each line in its group, every module with a line."""
    errors, heads, seen = [], [], set()
    for line in text.splitlines():
        if line.startswith("## "):
            heads.append(re.search(r"`([^`]+)`", line).group(1))
        elif line.startswith("- `"):
            named = re.findall(r"`([^`]+\.(?:py|md|sh)|[\w/]+/)`", line)  # files or folders
            if not named:
                errors.append(f"a line of docs/structure.md names no module: {line[:60]!r}")
                continue
            seen.update(named)
            home = max((g for g in STRUCTURE_GROUPS if named[0].startswith(g)), key=len,
                       default=None)
            if not heads or home != heads[-1]:
                errors.append(f"{named[0]} is in group {heads[-1] if heads else None}, not {home}")
    if heads != [g for g in STRUCTURE_GROUPS if g in heads]:
        errors.append(f"groups out of order: {heads}")
    errors += [f"{m} has no line" for m in modules if m not in seen]
    return errors


def listed_modules(paths: set[str]) -> list[str]:
    """The files docs/structure.md must list: modules (not package ``__init__``), scripts, docs."""
    keep = {"mambacache/__init__.py"}
    return sorted(p for p in paths if p in keep or (
        any(p.startswith(g) for g in STRUCTURE_GROUPS) and p.endswith((".py", ".sh", ".md"))
        and not p.endswith("__init__.py")))


def test_no_dangling_paths():
    paths = repo_paths()
    bad = [f"{src}: {ref}" for src, text in documents().items() for ref in dangling(text, paths)]
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


def test_python_m_modules_and_node_ids_exist():
    paths, bad = repo_paths(), []
    for src, text in documents().items():
        bad += [f"{src}: python -m {m}" for m in missing_modules(text, paths)]
        for path, name in NODE_RE.findall(text):
            body = (ROOT / path).read_text() if path in paths else ""
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", body, re.M):
                bad.append(f"{src}: {path}::{name}")
    assert not bad, "\n".join(bad)


def test_structure_lists_every_module_in_its_group():
    text = (ROOT / "docs" / "structure.md").read_text()
    errors = structure_errors(text, listed_modules(tracked_files()))
    assert not errors, "docs/structure.md:\n" + "\n".join(errors)


def test_checker_flags_ours_and_spares_other_projects():
    paths = {"mambacache/", "mambacache/parallel/", "mambacache/parallel/checkpoint.py",
             "configs/", "configs/bench/", "configs/bench/no_reuse.toml", "tests/",
             "tests/test_x.py", "mambacache/cache/", "mambacache/cache/insert.py"}
    text = ("`mambacache/checkpoint.py` and ``radix_insert.py`` moved to "
            "`mambacache/parallel/checkpoint.py`, `cache/insert.py`; `configs/bench/<p>.toml`, "
            "`tests/test_*.py`, `configs/x.toml`, `engine/gone.py`, `parallel/checkpoint.py`. "
            "Read SGLang's `mamba_radix_cache.py` and `python/sglang/srt/mem_cache/radix.py`, "
            "https://github.com/o/r/blob/main/mambacache/nothing.py, on/off, TP 2/4.")
    assert dangling(text, paths) == ["mambacache/checkpoint.py", "radix_insert.py",
                                     "configs/x.toml"]
    assert missing_modules("python -m mambacache.gone; python -m pytest", paths) == [
        "mambacache.gone"]


def test_structure_check_flags_a_missing_or_misplaced_line():
    text = ("## `mambacache/`\n\n- `mambacache/plan.py`: x\n\n## `mambacache/cache/`\n\n"
            "- `mambacache/cache/radix.py`: y\n- `mambacache/engine/engine.py`: z\n")
    errors = structure_errors(text, ["mambacache/plan.py", "mambacache/cache/radix.py",
                                     "mambacache/cache/node.py"])
    assert errors == ["mambacache/engine/engine.py is in group mambacache/cache/, "
                      "not mambacache/engine/", "mambacache/cache/node.py has no line"]
    assert structure_errors("## `models/`\n\n## `mambacache/`\n", []) == [
        "groups out of order: ['models/', 'mambacache/']"]
