"""The yard's layout: tests/, benchmarks/ and examples/ import nothing of each other (what several need lives in
flux_layers.devtools), and nothing edits sys.path."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = ("tests", "benchmarks", "examples")


def _python_files(folder: str):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _imported_tops(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def _edits_sys_path(node: ast.AST) -> bool:
    """A call of sys.path.<method>(...) or an assignment to sys.path."""
    def is_sys_path(n):
        return (isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
                and n.value.id == "sys")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return is_sys_path(node.func.value)
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(is_sys_path(t) for t in targets)
    return False


def test_no_folder_imports_another_and_no_sys_path_edits():
    crossing, path_edits, files = [], [], 0
    for folder in FOLDERS:
        for path in _python_files(folder):
            files += 1
            with open(path) as f:
                source = f.read()
            tree = ast.parse(source)
            crossing += [(os.path.relpath(path, ROOT), top) for top in _imported_tops(tree)
                         if top in FOLDERS and top != folder]
            if any(_edits_sys_path(node) for node in ast.walk(tree)):
                path_edits.append(os.path.relpath(path, ROOT))
    assert files > 30, f"only {files} files found under {FOLDERS}"
    assert not crossing, f"imports across tests/, benchmarks/, examples/: {crossing}"
    assert not path_edits, f"sys.path edited in {path_edits}"
