"""What `python -m xtrain --help` and the docs' reference say, from one source each: a group's options are the
YAML files in xtrain/conf/ (each described by its first comment line), a setting's description is the docstring under
its field in the schema (config.py, cluster_config.py, lora_config.py).

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from importlib.resources import files

import yaml

GROUPS = ("model", "data", "strategy", "precision", "cluster", "trainer", "tracker", "experiment")
COMMANDS = {
    "python -m xtrain.prepare OVERRIDES": "prepare the run's data ahead of time (nothing trains)",
    "python -m xtrain.status DIR": "where a run or a sweep stands, from its files",
    "python -m xtrain.env": "versions, devices, and what this machine can run",
}


def options(group: str) -> dict[str, str]:
    """A group's options, each with its description (the comment its file starts with)."""
    found = {}
    for path in sorted(files("xtrain.conf").joinpath(group).iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml"):
            about = []
            for line in path.read_text().splitlines():
                if not line.startswith("#"):
                    break
                if not line.startswith("# @package"):
                    about.append(line[1:].strip())
            found[path.name[:-len(".yaml")]] = " ".join(about)
    return found


def defaults() -> dict[str, str | None]:
    """Each group's default option, as xtrain/conf/config.yaml's defaults list has it."""
    entries = yaml.safe_load(files("xtrain.conf").joinpath("config.yaml").read_text())["defaults"]
    chosen: dict[str, str | None] = {}
    for entry in entries:
        if isinstance(entry, dict):
            for key, value in entry.items():
                chosen[key.split()[-1]] = value
    return chosen


def field_docs(schema) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal that follows it), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(schema)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(schema)}


def text() -> str:
    import xtrain
    from xtrain.config import RunConfig

    chosen, root = defaults(), field_docs(RunConfig)
    lines = [f"xtrain {xtrain.__version__}: declarative experiment configs for distributed PyTorch training", "",
             "usage: python -m xtrain [GROUP=OPTION ...] [SETTING=VALUE ...]        one run",
             "       python -m xtrain -m [GROUP=A,B ...] [SETTING=X,Y ...]          a sweep (or a study: "
             "hydra/sweeper=xtrain_optuna)", "",
             "Config groups (GROUP=OPTION):"]
    for group in GROUPS:
        found = options(group)
        default = chosen.get(group)
        lines.append(f"  {group}: {', '.join(found)}" + (f"  (default: {default})" if default else "  (default: none)"))
        width = max(len(name) for name in found)
        lines += [f"      {name:<{width}}  {about}" for name, about in found.items()]
    lines += ["", "Settings of every run (SETTING=VALUE):"]
    lines += [f"  {name:<10} {root[name]}" for name in ("run_dir", "resume", "resume_changes", "dry_run") if name in root]
    lines += ["  python -m xtrain --cfg job prints every setting with its value; the docs' reference describes each.", "",
              "Companion commands:"]
    lines += [f"  {command:<38} {about}" for command, about in COMMANDS.items()]
    lines += ["", "Hydra's own flags: --cfg job|hydra|all, --info, --hydra-help, -m (--multirun)."]
    return "\n".join(lines)
