"""The numbers a reviewer asks of the layering, for a checkout as it is:

    python experiments/structure.py [CHECKOUT]      # default: this repository

- lines per package under rlcore/ (every line, and the code lines: no blank, comment or docstring lines),
  with rlcore/trainer's total;
- the modules that import `configs` (anywhere in the module: function-local imports count);
- the functions over 50 lines (def to last line; methods and nested functions each count);
- the branches in `learn` and `build` (module-level functions of those names, found anywhere under rlcore/):
  if, elif, ternary, match case, boolean short-circuit (`a and b or c`: 2) and comprehension if, counted
  separately, nested functions included.

Reads the files only (ast); imports nothing of the checkout, so it runs on an older commit's worktree.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections import Counter
from pathlib import Path

LONG = 50
"""A function longer than this many lines is listed."""
BRANCHY = ("learn", "build")
"""The functions whose branches are counted."""
KINDS = ("if", "elif", "ternary", "match case", "short-circuit", "comprehension if")


def files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "rlcore").rglob("*.py") if "__pycache__" not in p.parts)


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not inside a docstring."""
    doc = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str):
            doc.update(range(node.lineno, node.end_lineno + 1))
    ignored = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in ignored:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - doc)


def package_of(root: Path, path: Path) -> str:
    """rlcore/<package>/ for a file in a package, the file itself for a root module."""
    parts = path.relative_to(root).parts
    return f"rlcore/{parts[1]}/" if len(parts) > 2 else f"rlcore/{parts[1]}"


def lines_per_package(root: Path) -> dict[str, tuple[int, int]]:
    """{package: (lines, code lines)}."""
    totals: dict[str, tuple[int, int]] = {}
    for path in files(root):
        source = path.read_text()
        lines, code = totals.get(package_of(root, path), (0, 0))
        totals[package_of(root, path)] = (lines + len(source.splitlines()), code + code_lines(source))
    return totals


def imports_configs(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        if any(n == "configs" or n.startswith("configs.") for n in names):
            return True
    return False


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def long_functions(root: Path) -> list[tuple[int, str]]:
    """(lines, file:line name) of every function over LONG lines, longest first."""
    found = []
    for path in files(root):
        for fn in functions(ast.parse(path.read_text())):
            length = fn.end_lineno - fn.lineno + 1
            if length > LONG:
                found.append((length, f"{path.relative_to(root)}:{fn.lineno} {fn.name}"))
    return sorted(found, key=lambda item: (-item[0], item[1]))


def branches(fn: ast.AST, lines: list[str]) -> Counter[str]:
    """Each kind of branch in `fn`'s body, counted separately."""
    counts: Counter[str] = Counter({kind: 0 for kind in KINDS})
    for node in ast.walk(fn):
        if isinstance(node, ast.If):
            counts["elif" if lines[node.lineno - 1][node.col_offset :].startswith("elif") else "if"] += 1
        elif isinstance(node, ast.IfExp):
            counts["ternary"] += 1
        elif isinstance(node, ast.match_case):
            counts["match case"] += 1
        elif isinstance(node, ast.BoolOp):
            counts["short-circuit"] += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            counts["comprehension if"] += len(node.ifs)
    return counts


def branchy_functions(root: Path) -> list[tuple[str, Counter[str]]]:
    """(file:line name, branch counts) of each module-level function named in BRANCHY."""
    found = []
    for path in files(root):
        source = path.read_text()
        for fn in ast.parse(source).body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name in BRANCHY:
                found.append(
                    (f"{path.relative_to(root)}:{fn.lineno} {fn.name}", branches(fn, source.splitlines()))
                )
    return found


def report(root: Path) -> list[str]:
    """The report's lines."""
    out = [f"checkout: {root}", "", "lines per package under rlcore/ (lines, code lines):"]
    totals = lines_per_package(root)
    out += [f"  {name:<24} {lines:>6} {code:>6}" for name, (lines, code) in sorted(totals.items())]
    out.append(
        f"  {'all of rlcore/':<24} {sum(v[0] for v in totals.values()):>6} {sum(v[1] for v in totals.values()):>6}"
    )
    trainer = totals.get("rlcore/trainer/", (0, 0))
    out += [f"rlcore/trainer/ total: {trainer[0]} lines, {trainer[1]} code lines", ""]
    readers = [str(p.relative_to(root)) for p in files(root) if imports_configs(ast.parse(p.read_text()))]
    out += [f"modules importing configs: {len(readers)}", *(f"  {r}" for r in readers), ""]
    long = long_functions(root)
    out += [f"functions over {LONG} lines: {len(long)}", *(f"  {n:>4}  {where}" for n, where in long), ""]
    for where, counts in branchy_functions(root):
        detail = ", ".join(f"{kind} {counts[kind]}" for kind in KINDS)
        out.append(f"branches in {where}: {sum(counts.values())} ({detail})")
    return out


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    print("\n".join(report(root)))


if __name__ == "__main__":
    main()
