"""The package's layout stays readable (issue 40): every subpackage says in one docstring line what
it owns, ``mambacache/engine/`` keeps about a dozen modules at its top (the rest by concern in
subpackages) and ``mambacache/`` at most six (the public API, config, the command entry points).
Host only; reads files, imports nothing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mambacache", "models", "pallas_kernels")
MAX_ENGINE_TOP = 12
MAX_ROOT_MODULES = 6


def package_docstring_errors(root: Path) -> list[str]:
    """A package ``__init__.py`` without a docstring, or whose summary is not one line."""
    errors = []
    for package in PACKAGES:
        for init in sorted((root / package).rglob("__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            rel = init.relative_to(root).as_posix()
            if not doc:
                errors.append(f"{rel} has no docstring")
            elif "\n" in doc.split("\n\n")[0].strip():
                errors.append(f"{rel}: its docstring's summary is not one line")
    return errors


def top_modules(folder: Path) -> list[str]:
    """The modules directly in ``folder`` (``__init__.py`` included)."""
    return sorted(p.name for p in folder.glob("*.py"))


def test_every_package_says_what_it_owns_in_one_line():
    assert package_docstring_errors(ROOT) == []


def test_the_check_flags_a_package_without_a_docstring(tmp_path):
    for name, text in {"a": '"""Owns a."""\n', "b": "x = 1\n", "c": '"""Two\nlines."""\n'}.items():
        (tmp_path / "mambacache" / name).mkdir(parents=True)
        (tmp_path / "mambacache" / name / "__init__.py").write_text(text)
    assert package_docstring_errors(tmp_path) == [
        "mambacache/b/__init__.py has no docstring",
        "mambacache/c/__init__.py: its docstring's summary is not one line"]


def test_engine_and_package_tops_stay_small():
    engine = top_modules(ROOT / "mambacache" / "engine")
    assert len(engine) <= MAX_ENGINE_TOP, engine
    root = top_modules(ROOT / "mambacache")
    assert len(root) <= MAX_ROOT_MODULES, root
