"""Ownership rules of the engine's host path, checked on the source (AST), each with a planted
violation showing the check fails:
  * only ``engine/leases/lease.py`` (with its mixins ``leases/pages.py`` and ``leases/windows.py``)
  and
    ``engine/leases/cache_manager.py`` write a lease field (assignment,
    augmented assignment, item assignment, ``del`` or a mutating method call on the field);
  * no module reads or writes another object's private attribute: ``engine._x`` / ``sched._x``
    (the engine's objects) nowhere in ``mambacache/``; any ``obj._x`` nowhere in the engine's
    host path and its tools, but ``self._x``, ``cls._x`` and privates of the module's own
    classes;
  * no module of ``mambacache/``, ``models/`` or ``pallas_kernels/`` imports another module's
    private name (``from x import _y``).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from mambacache.engine.leases.lease import LEASE_FIELDS

ROOT = Path(__file__).resolve().parents[1]
LEASE_WRITERS = {"mambacache/engine/leases/lease.py", "mambacache/engine/leases/pages.py",
                 "mambacache/engine/leases/windows.py", "mambacache/engine/leases/cache_manager.py"}
#: the tree's integrity check rebuilds every count from the allocators' and the tree's own
#: internals: an auditor reading private state on purpose (``cache/integrity.py`` docstring)
PRIVATE_READERS = {"mambacache/cache/integrity.py"}
#: where every cross-object private access fails (the engine's host path and its tools)
PRIVATE_CHECKED = ("mambacache/engine/", "mambacache/parallel/", "mambacache/bench/",
                   "mambacache/cache/")
#: names of the engine's objects: ``<name>._x`` fails in every module
ENGINE_OBJECTS = {"engine", "eng", "scheduler", "sched", "runner", "manager", "lease", "loop",
                  "speculative", "spec_decoder"}
MUTATORS = {"add", "append", "clear", "difference_update", "discard", "extend", "insert",
            "intersection_update", "pop", "popitem", "remove", "setdefault", "sort",
            "symmetric_difference_update", "update"}


@functools.cache
def _parsed(*folders: str) -> dict[str, ast.Module]:
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text())
            for folder in folders or ("mambacache",) for p in sorted((ROOT / folder).rglob("*.py"))}


def _sources(planted_in: str | None = None, code: str = "") -> dict[str, ast.Module]:
    """Every module of ``mambacache/`` parsed; ``code`` appended to ``planted_in``."""
    out = dict(_parsed())
    if planted_in is not None:
        path = ROOT / planted_in
        out[planted_in] = ast.parse(path.read_text() + code)
    return out


def _stored(node: ast.AST) -> list[ast.expr]:
    """The expressions ``node`` stores into (tuple targets unpacked)."""
    if isinstance(node, ast.Assign | ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    for t in targets:
        out += list(t.elts) if isinstance(t, ast.Tuple | ast.List) else [t]
    return out


def lease_writes(sources: dict[str, ast.Module]) -> list[str]:
    """``path:line expr`` of every write to a lease field outside the lease's own modules."""
    found = []
    for path, tree in sources.items():
        if path in LEASE_WRITERS:
            continue
        for node in ast.walk(tree):
            hits = [t.value if isinstance(t, ast.Subscript) else t for t in _stored(node)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MUTATORS:
                hits.append(node.func.value)
            found += [f"{path}:{node.lineno} {ast.unparse(h)}" for h in hits
                      if isinstance(h, ast.Attribute) and h.attr in LEASE_FIELDS]
    return found


def _module_names(tree: ast.Module) -> set[str]:
    """Classes and functions the module itself defines (their privates are the module's)."""
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}


def _base_name(node: ast.expr) -> str | None:
    """``engine`` for ``self.engine.scheduler``: the names along an attribute chain, last first."""
    while isinstance(node, ast.Attribute):
        if node.attr in ENGINE_OBJECTS:
            return node.attr
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_accesses(sources: dict[str, ast.Module]) -> list[str]:
    """``path:line expr`` of every ``obj._name`` whose ``obj`` is not ``self``, ``cls`` or a
    class / function of the same module: everywhere in ``PRIVATE_CHECKED``, and on the engine's
    objects (``ENGINE_OBJECTS``: ``engine._x``, ``self.engine.scheduler._x``) everywhere."""
    found = []
    for path, tree in sources.items():
        if path in PRIVATE_READERS:
            continue
        own = {"self", "cls"} | _module_names(tree)
        checked = path.startswith(PRIVATE_CHECKED)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                    or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in own:
                continue
            if checked or _base_name(node.value) in ENGINE_OBJECTS:
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def private_imports(sources: dict[str, ast.Module]) -> list[str]:
    """``path:line name`` of every ``from <module> import _name`` (dunders aside): a private
    helper another module needs is public under a name of its own."""
    return [f"{path}:{node.lineno} {alias.name}" for path, tree in sources.items()
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if alias.name.startswith("_") and not alias.name.startswith("__")]


def test_only_the_lease_writes_lease_fields():
    assert lease_writes(_sources()) == []


def test_no_private_access_across_objects():
    assert private_accesses(_sources()) == []


def test_no_private_import_across_modules():
    assert private_imports(_parsed("mambacache", "models", "pallas_kernels")) == []
    planted = private_imports(_sources("mambacache/bench/report.py",
                                       "\nfrom mambacache.bench.runner import _helper\n"))
    assert len(planted) == 1 and planted[0].startswith("mambacache/bench/report.py"), planted


@pytest.mark.parametrize("planted", [
    "req.lease.state_slot = 3",
    "lease.num_computed += 1",
    "s.req.lease.pending_snapshots[8] = 5",
    "other.lease.snapshots_in_flight.update([4])",
    "lease.node, lease.read_slot = None, None",
    "del req.lease.scratch_slots",
])
def test_planted_lease_write_is_found(planted):
    path = "mambacache/engine/scheduler.py"
    code = f"\n\ndef _planted(req, lease, s, other):\n    {planted}\n"
    found = lease_writes(_sources(path, code))
    assert found and all(f.startswith(path) for f in found), found


@pytest.mark.parametrize("path, planted", [
    ("mambacache/engine/speculative/verify.py", "engine._advance(s)"),
    ("mambacache/engine/speculative/verify.py", "Scheduler._spec(sched, s)"),
    ("mambacache/serve/metrics.py", "sched._grow(req, 8)"),
    ("mambacache/serve/metrics.py", "x = self.engine.scheduler._out"),
])
def test_planted_private_access_is_found(path, planted):
    found = private_accesses(_sources(path, f"\n\ndef _planted(self, engine, sched, s, req):"
                                            f"\n    {planted}\n"))
    assert len(found) == 1 and found[0].startswith(path), found
