"""No two modules of rlcore/ define a public class of the same name: a reader (and an import) never has to ask
which `Sample` or `Setup` is meant."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

RLCORE = Path(__file__).resolve().parents[1] / "rlcore"


def public_classes(source: str) -> list[str]:
    """The public classes a module defines at its top level (a leading underscore marks a private one)."""
    return [node.name for node in ast.parse(source).body
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]  # fmt: skip


def shared_names(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each public class name that more than one module defines, with those modules."""
    where = defaultdict(list)
    for module, source in sorted(sources.items()):
        for name in public_classes(source):
            where[name].append(module)
    return {name: modules for name, modules in where.items() if len(modules) > 1}


def test_shared_names_finds_a_class_two_modules_define():
    sources = {"a.py": "class Setup:\n    pass\nclass _Own:\n    pass\n",
               "b.py": "class Setup:\n    pass\nclass _Own:\n    pass\nclass Other:\n    pass\n"}  # fmt: skip
    assert shared_names(sources) == {"Setup": ["a.py", "b.py"]}


def test_no_two_modules_define_a_public_class_of_the_same_name():
    sources = {str(p.relative_to(RLCORE.parent)): p.read_text() for p in RLCORE.rglob("*.py")}
    shared = shared_names(sources)
    assert not shared, "; ".join(f"{name} in {', '.join(modules)}" for name, modules in sorted(shared.items()))
