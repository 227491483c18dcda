"""The package's layers (docs/concepts/architecture.md): each folder is one layer, imports point only down, no
module imports in a cycle, and result.json has one writer."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "xtrain"

# Bottom to top. A module may import its own folder and the folders before it; folders on one line import
# neither each other nor anything above.
LAYERS = [("core",), ("config", "conf"), ("data",), ("parallel",), ("tasks",), ("engine",), ("launch",),
          ("backends",), ("sweeps",), ("commands", "decorator")]
ENTRY = {"xtrain.__main__", "xtrain.prepare", "xtrain.status", "xtrain.env", "xtrain.eval", "xtrain.export"}  # `python -m xtrain[.<command>]`


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def rank(module: str) -> int:
    if module in ENTRY:
        return len(LAYERS)
    for i, names in enumerate(LAYERS):
        if folder(module) in names:
            return i
    raise AssertionError(f"{module}: in no layer; put it in one of the layer folders")


def with_packages(module: str) -> set[str]:
    """A module and the packages above it, which Python imports first (their `__init__`s run); not the root."""
    parts = module.split(".")
    return {".".join(parts[:n]) for n in range(2, len(parts) + 1)}


def imports() -> dict[str, set[str]]:
    """Each xtrain module → the xtrain modules and packages it imports, at any depth (function-level too)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                           for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("xtrain."):
                    found |= {t for t in with_packages(target) if t in MODULES}
        graph[name] = found - {name}
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


def test_every_module_is_in_a_layer_folder_and_imports_only_down():
    graph = imports()
    assert set(graph) - {"xtrain"} - ENTRY == {m for m in graph if folder(m)}, "a module outside the layer folders"
    upward = sorted(f"{src} -> {dst}" for src, dsts in graph.items() if src != "xtrain" for dst in dsts
                    if folder(src) != folder(dst) and rank(dst) >= rank(src))
    assert upward == []
    assert sum(len(d) for d in graph.values()) > 300  # the walk sees the imports (function-level ones included)


def test_no_import_cycle_among_xtrain_modules_and_packages():
    assert cycle(imports()) is None


def test_each_layer_says_what_it_holds_and_may_import_and_no_init_does_more():
    """A layer's `__init__` is its docstring, ending with the layers it may import; the root imports lazily."""
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        docstring = ast.get_docstring(tree)
        assert docstring, name
        if name == "xtrain":  # the public face: `xtrain.run_with_accelerate`, `xtrain.load_model`, on first use
            assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                        and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")], name
            continue
        assert len(tree.body) == 1, f"{name}: its __init__ holds more than a docstring"
        if name.count(".") == 1 and name != "xtrain.conf":
            below = [n for names in LAYERS[:rank(name + ".x")] for n in names if n != "conf"]
            expected = f"May import: {', '.join(below)}." if below else "May import: nothing of xtrain."
            assert docstring.splitlines()[-1] == expected, name


def test_the_architecture_page_draws_the_layers_the_folders_hold():
    page = (REPO / "docs" / "concepts" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)/` \|", page, re.M)
    assert rows == [name for names in LAYERS for name in names if name != "conf"]
    assert sorted(rows) == sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and p.name != "conf")


def test_imports_point_one_way():
    graph = imports()
    assert graph["xtrain.core.errors"] == set()  # the leaf every module may import
    assert not any(m.startswith("xtrain.backends.slurm") for m in reaches(graph, "xtrain.launch.preflight"))
    assert not {"xtrain.data", "xtrain.tasks.causal_lm.model"} & graph["xtrain.engine.loop"]  # through a task


def test_no_module_is_much_over_400_lines():
    sizes = {name: len(p.read_text().splitlines()) for name, p in MODULES.items()}
    assert max(sizes.values()) <= 440, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_result_json_is_written_through_one_helper():
    """Only rundir.update_result writes result.json; everyone else goes through it."""
    writers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and path.name != "rundir.py":
                text = ast.get_source_segment(path.read_text(), node) or ""
                if "RESULT" in text and ("write_atomic" in text or "write_text" in text):
                    writers.append(f"{path.name}:{node.name}")
    assert writers == []


def test_importing_xtrain_modules_installs_no_warning_filter():
    """No import-time side effects outside xtrain's own loggers."""
    code = ("import warnings, logging, torch, accelerate, transformers, datasets, tqdm.auto, tqdm.contrib.logging; "
            "before = list(warnings.filters); "
            "import xtrain.engine.loop, xtrain.engine.accelerator, xtrain.backends.local; "
            "assert warnings.filters == before, 'warning filter installed'; "
            "assert not logging.getLogger('transformers.modeling_utils').filters; "
            "assert not logging.getLogger('accelerate.utils.other').filters")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_backend_has_the_backend_protocols_functions():
    """`backend_for` returns modules; each has every function of `Backend`, taking its parameters by the same names."""
    import inspect

    from xtrain.backends.base import Backend
    from xtrain.backends.registry import backend_for
    from xtrain.config.cluster import ClusterKind

    for kind in ClusterKind:
        backend = backend_for(kind)
        assert isinstance(backend, Backend), kind
        for name, function in inspect.getmembers(Backend, inspect.isfunction):
            if name.startswith("_"):
                continue
            wanted = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
            has = inspect.signature(getattr(backend, name)).parameters
            for p in wanted:
                if p.kind is p.VAR_KEYWORD:
                    continue
                assert p.name in has, f"{backend.__name__}.{name} lacks {p.name}"
