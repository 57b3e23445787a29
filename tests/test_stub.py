"""cascade/_core.pyi, the type stub the build writes from the extension
(nanobind's stubgen with cmake/core_stub_patterns.txt), declares everything
the extension has, and each exception class with the bases it has there."""

import ast
import builtins
import inspect
from pathlib import Path

import pytest

from cascade import _core

STUB = Path(_core.__file__).with_name("_core.pyi")
pytestmark = pytest.mark.skipif(
    not STUB.is_file(), reason=f"no {STUB.name} beside the extension (built without it)"
)


def stub_tree():
    return ast.parse(STUB.read_text())


def top_level(tree):
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def test_every_public_name_is_declared():
    declared = top_level(stub_tree())
    missing = sorted(n for n in dir(_core) if not n.startswith("_") and n not in declared)
    assert not missing, f"{STUB.name} lacks {missing}"


def test_exception_classes_have_their_bases():
    declared = top_level(stub_tree())
    errors = [
        n
        for n in dir(_core)
        if isinstance(getattr(_core, n), type) and issubclass(getattr(_core, n), BaseException)
    ]
    assert "CascadeError" in errors
    for name in errors:
        node = declared[name]
        assert isinstance(node, ast.ClassDef), name
        stub_bases = [ast.unparse(b) for b in node.bases]
        real_bases = [b.__name__ for b in getattr(_core, name).__bases__]
        assert stub_bases == real_bases, name
        for base in real_bases:
            assert base in declared or hasattr(builtins, base), base


def test_public_methods_of_classes_are_declared():
    declared = top_level(stub_tree())
    for name in dir(_core):
        cls = getattr(_core, name)
        if name.startswith("_") or not isinstance(cls, type) or issubclass(cls, BaseException):
            continue
        node = declared[name]
        members = {
            m.name if isinstance(m, (ast.FunctionDef, ast.ClassDef)) else ast.unparse(m.target)
            for m in node.body
            if isinstance(m, (ast.FunctionDef, ast.ClassDef, ast.AnnAssign))
        }
        members |= {
            t.id
            for m in node.body
            if isinstance(m, ast.Assign)
            for t in m.targets
            if isinstance(t, ast.Name)
        }
        # Python functions attached to a class by the package (cascade.config)
        # are not the extension's.
        public = {
            m
            for m, v in vars(cls).items()
            if not m.startswith("_") and not inspect.isfunction(getattr(v, "__func__", v))
        }
        assert public <= members, f"{name}: {sorted(public - members)}"
