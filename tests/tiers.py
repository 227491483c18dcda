"""The suite's tiers, found from what each test does, so a new test lands in its tier by itself:

- `unit`: starts no run and no process (pure functions, the config, the plan's figures, plugin settings);
- `component`: runs xtrain on a tiny task in this process only (the CLI's `main` or the loop, one DDP process);
- `e2e`: starts processes (a subprocess, torchrun's ranks, a sharded strategy's seam, SLURM, a process of its own)
  or trains what is not tiny (a pretrained LM, compiled kernels).

A test is what it, the functions it calls and the fixtures it uses (at any depth, across the test modules and
conftest.py) name: a name of RUNS starts a run, one of E2E or, where it runs xtrain, a seam or a setting of E2E_SETTINGS
makes it end to end. `make test-fast` runs the unit and component tiers; CI runs all three. conftest.py fails a
unit or component test that starts a process after all: its tier is then wrong, and a name here is missing."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

TESTS = Path(__file__).resolve().parent
RUNS = frozenset({"xtrain_in_process", "run_xtrain", "train", "run_with_accelerate"})
E2E = frozenset({"subprocess", "Popen", "forkserver", "start_xtrain", "multiprocessing", "slurm_cluster", "own_process",
                 "smollm2_dir"})
SEAMS = frozenset({"ZERO_ON_CPU", "FSDP_ON_CPU", "FP8_ON_CPU", "seams"})  # (a run on them starts ranks or is slow)
# what makes a run start processes or train more than a tiny task: several ranks or nodes, a strategy that needs a
# launcher, points in parallel, an environment read as a process starts (conftest.AT_START), compiled kernels
E2E_SETTINGS = re.compile(r"num_processes=([2-9]|auto)|nodes=[2-9]|strategy=(fsdp|zero)|^(PYTHONPATH|"
                          r"OMP_NUM_THREADS|TORCH_LOGS|HOME)$|cluster=slurm|trainer.compile=true|n_jobs=[2-9]")


@cache
def _functions() -> dict[str, tuple[set[str], set[str]]]:
    """Every function of the test modules (fixtures too) → (the names it reads, the strings it holds)."""
    found: dict[str, tuple[set[str], set[str]]] = {}
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names, strings = found.setdefault(node.name, (set(), set()))
                # (not its parametrize decorators: each case's own parameters count, `tier` adds them)
                decorators = [d for d in node.decorator_list if "parametrize" not in ast.unparse(d)]
                for n in ast.walk(ast.Module(body=[*decorators, *node.body], type_ignores=[])):
                    if isinstance(n, ast.Name) and n.id != node.name:
                        names.add(n.id)
                    elif isinstance(n, ast.keyword) and n.arg:
                        names.add(n.arg)
                        if isinstance(n.value, ast.Constant):  # run_with_accelerate(num_processes=2)
                            strings.add(f"{n.arg}={n.value.value}")
                    elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                        strings.add(n.value)
    return found


@cache
def _reach(function: str) -> tuple[frozenset[str], frozenset[str]]:
    """The names and strings `function` and everything it calls hold."""
    graph = _functions()
    names, strings, seen, todo = set(), set(), set(), [function]
    while todo:
        name = todo.pop()
        if name in seen or name not in graph or name in RUNS | E2E and name != function:
            continue  # (the helpers that start runs are known by name: what they hold inside is theirs)
        seen.add(name)
        read, held = graph[name]
        names |= read
        strings |= held
        todo += list(read)
    return frozenset(names), frozenset(strings)


def tier(item) -> str:
    """`unit`, `component` or `e2e` for a collected test (its parameters' strings counted)."""
    names, strings = set(), {str(v) for v in getattr(getattr(item, "callspec", None), "params", {}).values()}
    for function in [getattr(item, "originalname", item.name), *set(item.fixturenames) - {"tier_kept"}]:
        reached_names, reached_strings = _reach(function)
        names |= reached_names
        strings |= reached_strings
    if names & E2E or names & RUNS and (names & SEAMS or any(E2E_SETTINGS.search(s) for s in strings)):
        return "e2e"
    return "component" if names & RUNS else "unit"
