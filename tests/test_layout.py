"""The module layout the docs describe (concepts/flow.md): imports point one way, and result.json has one writer."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "xtrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each xtrain module → the xtrain modules it imports, function-level imports included."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:  # `from xtrain import x`: the module x
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_cycle_among_xtrain_modules():
    assert cycle(imports()) is None


def test_imports_point_one_way():
    graph = imports()
    assert graph["xtrain.errors"] == set()  # the leaf every module may import
    for backend in ("xtrain.backends.local", "xtrain.backends.slurm"):
        assert "xtrain.sweep" not in reaches(graph, backend), backend
    assert not any(m.startswith("xtrain.slurm") for m in reaches(graph, "xtrain.launch"))
    for reader in ("xtrain.summary", "xtrain.status"):
        assert "xtrain.sweep" not in reaches(graph, reader), reader
    assert not {"xtrain.data", "xtrain.model"} & graph["xtrain.loop"]  # the loop reaches them through a task


def test_no_module_is_much_over_400_lines():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= 440, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_result_json_is_written_through_one_helper():
    """Only run_dir.update_result writes result.json; everyone else goes through it."""
    writers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and path.name != "run_dir.py":
                text = ast.get_source_segment(path.read_text(), node) or ""
                if "RESULT" in text and ("write_atomic" in text or "write_text" in text):
                    writers.append(f"{path.name}:{node.name}")
    assert writers == []


def test_importing_xtrain_modules_installs_no_warning_filter():
    """No import-time side effects outside xtrain's own loggers."""
    import subprocess
    import sys

    code = ("import warnings, logging, torch, accelerate, transformers, datasets, tqdm.auto, tqdm.contrib.logging; "
            "before = list(warnings.filters); "
            "import xtrain.loop, xtrain.accelerator, xtrain.backends.local; "
            "assert warnings.filters == before, 'warning filter installed'; "
            "assert not logging.getLogger('transformers.modeling_utils').filters; "
            "assert not logging.getLogger('accelerate.utils.other').filters")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
