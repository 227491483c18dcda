"""What `python -m xtrain --help` and the docs' reference say, from one source each: a group's options are the
YAML files in xtrain/conf/ (each described by its first comment line), a setting's description is the docstring under
its field in the schema (config.py and the *_config.py modules beside it).

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from importlib.resources import files

import yaml

GROUPS = ("task", "model", "data", "strategy", "precision", "cluster", "trainer", "tracker", "experiment", "debug")
COMMANDS = {
    "python -m xtrain.prepare OVERRIDES": "prepare the run's data ahead of time (nothing trains)",
    "python -m xtrain.status DIR": "where a run or a sweep stands, from its files",
    "python -m xtrain.eval RUN_DIR [split=test] [predictions=FILE]": "evaluate a trained run's model/ (eval.json)",
    "python -m xtrain.export RUN_DIR [step=N] [out=DIR]": "a checkpoint as a whole model dir (from_pretrained)",
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
    docs = {}
    for cls in reversed([c for c in schema.__mro__ if dataclasses.is_dataclass(c)]):  # (an option's: its base's too)
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).split()) or docs.get(node.target.id, "")
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(schema)}


def text() -> str:
    import xtrain
    from xtrain.config.schema import RunConfig

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
    lines += ["  python -m xtrain --help GROUP lists a group's settings with their defaults and meanings (--help trainer);",
              "  python -m xtrain --cfg job prints every setting with its value.", "",
              "A study's settings (-m hydra/sweeper=xtrain_optuna; the tuning guide describes each):",
              f"  hydra.sweeper.{{{', '.join(study_settings())}}}", "",
              "Companion commands:"]
    lines += [f"  {command:<38} {about}" for command, about in COMMANDS.items()]
    lines += ["", "Hydra's own flags: --cfg job|hydra|all, --info, --hydra-help, -m (--multirun)."]
    return "\n".join(lines)


def study_settings() -> list[str]:
    """`hydra/sweeper=xtrain_optuna`'s settings (the sweeper's own config)."""
    from hydra_plugins.xtrain_launcher.sweeper import SETTINGS

    return SETTINGS


def reference() -> str:
    """The docs' configuration reference (markdown): each group's options, then every setting with its type,
    default and description, from the same sources as `--help`."""
    import typing

    from xtrain.config.schema import OPTION_SCHEMAS, RunConfig

    hints = typing.get_type_hints(RunConfig)  # a group typed by its option (model): its schema's default
    hints.update({f.name: type(f.default_factory()) for f in dataclasses.fields(RunConfig)
                  if f.default_factory is not dataclasses.MISSING and f.name not in OPTION_SCHEMAS})
    hints.update({group: type(getattr(RunConfig(), group)).__mro__[1] for group in OPTION_SCHEMAS})  # (the base)
    chosen, root = defaults(), field_docs(RunConfig)
    out = []
    for group in GROUPS:
        out += [f"## `{group}`", "", "| option | what |", "| --- | --- |"]
        out += [f"| `{name}`{' (default)' if name == chosen.get(group) else ''} | {_cell(about)} |"
                for name, about in options(group).items()]
        out.append("")
        if group in hints and dataclasses.is_dataclass(hints[group]):
            out += ["| setting | type | default | what |", "| --- | --- | --- | --- |"]
            out += _settings(hints[group], group)
            out.append("")
        if group in OPTION_SCHEMAS:  # each option's own settings, after those every option reads
            every = {f.name for f in dataclasses.fields(hints[group])}
            for option in dict.fromkeys(OPTION_SCHEMAS[group][2].values()):
                rows = _settings(option, group, skip=every)
                names = "|".join(name.value for name in option.NAMES)
                if rows:
                    out += [f"Settings of `{group}={names}` alone:", "", "| setting | type | default | what |",
                            "| --- | --- | --- | --- |", *rows, ""]
    out += ["## Settings of every run", "", "| setting | type | default | what |", "| --- | --- | --- | --- |"]
    defaults_of = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    out += [f"| `{name}` | `{_type(hints[name])}` | `{defaults_of[name]}` | {_cell(root[name])} |"
            for name in root if name not in hints or not dataclasses.is_dataclass(hints[name])]
    return "\n".join(out) + "\n"


def habits_table() -> str:
    """Other tools' names for xtrain's settings (config/habits.py), as the reference shows them."""
    from xtrain.config import habits

    rows = [f"| {name} | {tool} | {_cell(means)} |" for name, tool, means in habits.rows()]
    return "\n".join(["## Names from other tools", "",
                      "Lightning's Trainer, lightning-hydra-template and the HF Trainer call some of these settings "
                      "by other names. xtrain refuses those names in one line that gives its own override:", "",
                      "| their name | whose | xtrain's |", "| --- | --- | --- |", *rows]) + "\n"


GENERATED = {  # a page's generated parts, between its markers: the text that replaces each
    "config-reference": lambda: reference() + "\n" + habits_table(),
    "help": lambda: "```\n" + text() + "\n```",
}


def refreshed(markdown: str) -> str:
    """A docs page with its generated parts written anew (between `<!-- xtrain:NAME -->` and
    `<!-- /xtrain:NAME -->`): the pages in the repository read as the site does, and a test keeps them current."""
    for name, make in GENERATED.items():
        start, end = f"<!-- xtrain:{name} -->", f"<!-- /xtrain:{name} -->"
        if start in markdown and end in markdown:
            head, rest = markdown.split(start, 1)
            markdown = f"{head}{start}\n{make()}\n{end}{rest.split(end, 1)[1]}"
    return markdown


def _settings(schema, prefix: str, skip: set[str] = frozenset()) -> list[str]:
    return [f"| `{name}` | `{kind}` | `{default}` | {_cell(about)} |"
            for name, kind, default, about in _described(schema, prefix, skip)]


def _described(schema, prefix: str, skip: set[str] = frozenset()) -> list[tuple[str, str, str, str]]:
    """Each setting of `schema` (nested ones dotted): its name, type, default and description."""
    import typing

    hints, docs, rows = typing.get_type_hints(schema), field_docs(schema), []
    for f in dataclasses.fields(schema):
        if f.name in skip:
            continue
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            rows += _described(kind, f"{prefix}.{f.name}")
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        rows.append((f"{prefix}.{f.name}", _type(kind), _value(default), docs[f.name]))
    return rows


def group_text(group: str) -> str:
    """`python -m xtrain --help GROUP`: the group's options, then each setting with its type, default and meaning."""
    from xtrain.config.schema import OPTION_SCHEMAS

    chosen = defaults().get(group)
    lines = [f"{group}: choose an option with {group}=OPTION" + (f" (default: {chosen})" if chosen else ""), ""]
    lines += [f"  {name}{' (default)' if name == chosen else ''}: {about}" for name, about in options(group).items()]
    schemas = _group_schemas(group)
    every = {f.name for f in dataclasses.fields(schemas[0][1])} if schemas and group in OPTION_SCHEMAS else set()
    for title, schema in schemas:
        lines += ["", f"{title} (SETTING=VALUE):"]
        for name, kind, default, about in _described(schema, group, skip=every if schema is not schemas[0][1] else set()):
            lines.append(f"  {name} = {default}   ({kind})")
            lines += textwrap.wrap(about, 110, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _group_schemas(group: str) -> list[tuple[str, type]]:
    """The schemas whose settings a group has: the one every option reads, then each option's own."""
    from xtrain.config.schema import OPTION_SCHEMAS, RunConfig

    if group in OPTION_SCHEMAS:
        base = type(getattr(RunConfig(), group)).__mro__[1]
        found = [(f"Settings of every {group} option", base)]
        for option in dict.fromkeys(OPTION_SCHEMAS[group][2].values()):
            found.append((f"Settings of {group}={'|'.join(name.value for name in option.NAMES)} alone", option))
        return found
    value = getattr(RunConfig(), group, None)
    return [(f"Settings of {group}", type(value))] if dataclasses.is_dataclass(value) else []


def _type(kind) -> str:
    import enum
    import typing

    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (list, typing.List):
        return f"list of {_type(args[0])}"
    if args and len(args) < len(typing.get_args(kind)):  # Optional[X]
        return f"{_type(args[0])} or null"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return " / ".join(str(m.value) for m in kind)
    return getattr(kind, "__name__", str(kind))


def _value(value) -> str:
    value = getattr(value, "value", value)  # an Enum's
    return "null" if value is None else str(value).replace("|", "/")


def _cell(text: str) -> str:
    """A description as a table cell: `|` escaped, and outside code spans `_` and `*` too (else `_target_` would
    render as an italic "target")."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("_", "\\_").replace("*", "\\*").replace("|", "\\|")
    return "`".join(parts) or "—"
