"""`python -m xtrain`: Hydra composes xtrain/conf/ over the typed schema, then the backend of `cluster.kind` runs it.

User errors (bad values, unknown keys, missing files) end as one line on stderr and
exit code 2. This module imports neither torch nor transformers: `--cfg job` and
`--help` stay fast.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from xtrain.commands import bounds
from xtrain.config import schema
from xtrain.config.schema import RunConfig
from xtrain.core import runlock
from xtrain.core.errors import ONE_LINE, ConfigError, LaunchFailed, Stopped, SweepFailed
from xtrain.core.files import keep_private
from xtrain.sweeps import sweep_dir

GROUP_SCHEMAS = {
    "model": schema.ModelConfig,
    "precision": schema.PrecisionConfig,
    "trainer": schema.TrainerConfig,
    "tracker": schema.TrackerConfig,
    "task": schema.TaskConfig,
}
CONFIG_GROUPS = (*GROUP_SCHEMAS, *schema.OPTION_SCHEMAS)  # every group of the run config (their options: conf/)


def register_schemas() -> None:
    make_launchers_visible()  # xtrain/conf/config.yaml names hydra/launcher=xtrain
    store = ConfigStore.instance()
    if "run_config.yaml" in store.repo:  # (stored already by this process)
        return
    root = OmegaConf.structured(RunConfig)
    root.model = "???"  # typed by the group option: a schema's, or a user's own by _target_
    for group in schema.OPTION_SCHEMAS:
        root[group] = "???"  # typed by the group option's own schema (data: or a user's datasets by _target_)
    store.store(name="run_config", node=root)
    for group, node in GROUP_SCHEMAS.items():
        store.store(group=f"schema/{group}", name="base", node=node)  # extended by xtrain/conf/<group>/*.yaml
    for group, (_, _, options) in schema.OPTION_SCHEMAS.items():
        for option in set(options.values()):  # FsdpConfig as schema/strategy/fsdp, extended by conf/strategy/fsdp.yaml
            store.store(group=f"schema/{group}", name=schema_name(option), node=option)


def schema_name(option) -> str:
    """The name an option's schema is stored by: FsdpConfig as `fsdp`, ZeroConfig as `zero`, TextData as `text`."""
    return option.__name__.removesuffix("Config").removesuffix("Data").lower()


def command_argv(doc: str, argv: list[str] | None) -> list[str] | None:
    """A `python -m xtrain.<command>`'s arguments (sys.argv's by default), or None where it printed its help (its
    module's `doc`); the files it writes are private to the user (`keep_private`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"--help", "-h"} & set(argv):
        print(doc.strip().strip('"'))
        return None
    from xtrain.core.files import keep_private

    keep_private()
    return argv


def tell(line: str) -> None:
    """A line on stderr; nothing where the terminal is gone (closed: EIO), which must not change how the command
    ends."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def fail(message: str) -> None:
    tell(f"xtrain: error: {message}")
    sys.exit(2)


@hydra.main(config_path="pkg://xtrain.conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig):
    output_dir = HydraConfig.get().runtime.output_dir
    try:
        cfg.run_dir = output_dir
        from xtrain.backends.registry import backend_for, resolve_auto

        resolved = resolve_auto(schema.from_container(cfg))
        return backend_for(resolved.cluster.kind).run(resolved).get("val_loss")
    except (ConfigError, OmegaConfBaseException) as err:
        # Exit here: an exception leaving the task makes Hydra print its own report first.
        _report_refusal(err)
    except LaunchFailed as err:
        tell(f"xtrain: error: {err}")
        sys.exit(err.exit_code)
    except Stopped as err:  # on request, at a step boundary, with a checkpoint: not an error
        tell(f"xtrain: {err}")
        sys.exit(err.exit_code)
    except ONE_LINE as err:
        tell(f"xtrain: error: {err}")
        sys.exit(1)
    except KeyboardInterrupt as err:  # a second Ctrl-C (the first stops at a step boundary), or one before training
        how = str(err) or "stopped at once by Ctrl-C"
        tell(f"xtrain: {how}; to continue from the newest checkpoint, run the same command with run_dir={output_dir} "
             "resume=auto")
        sys.exit(130)
    finally:  # a dry run or a refused run leaves no empty run dir behind
        _remove_if_empty(Path(output_dir))


_FOLDERS_BEFORE: set[str] = set()  # the run dir's folder and those above it that were there before this command


def _note_folders_before(run_dirs: list[str]) -> None:
    _FOLDERS_BEFORE.clear()
    for given in run_dirs:
        path = Path(os.path.expanduser(given)).absolute()
        for folder in (path, *path.parents):
            if os.path.isdir(folder):
                _FOLDERS_BEFORE.add(os.path.realpath(folder))


def _remove_if_empty(path: Path) -> None:
    """The empty run dir Hydra made for this command, and the empty folders it made above it (`runs/`): a folder
    that was there before is the user's, and stays."""
    path = Path(path).absolute()
    while os.path.realpath(path) not in _FOLDERS_BEFORE and path.is_dir() and not any(path.iterdir()):
        try:
            path.rmdir()
        except OSError:  # (a read-only one: refused already)
            return
        path = path.parent


def make_launchers_visible() -> None:
    """Hydra finds launchers by listing `hydra_plugins.__path__`; a setuptools editable install serves the
    package through an import hook that such a listing cannot see. Put its real folder on sys.path."""
    spec = importlib.util.find_spec("hydra_plugins.xtrain_launcher")
    if spec is not None and spec.origin is not None:
        root = str(Path(spec.origin).parents[2])
        if root not in sys.path:
            sys.path.append(root)


def main() -> None:
    asked = set(sys.argv[1:])
    if "--version" in asked:
        from xtrain import __version__

        print(f"xtrain {__version__}")
        return
    if asked & {"--help", "-h"}:
        from xtrain.commands import help

        after = sys.argv[sys.argv.index("--help" if "--help" in asked else "-h") + 1:][:1]
        if after and not after[0].startswith("-") and "=" not in after[0]:
            if after[0] not in help.GROUPS:
                fail(f"--help {after[0]}: no such config group; choose one of {', '.join(help.GROUPS)}")
            print(help.group_text(after[0]))
            return
        print(help.text())
        return
    keep_private()
    sys.argv[1:] = arguments(sys.argv[1:])
    run_dirs = [arg.partition("=")[2] for arg in sys.argv[1:] if arg.startswith("run_dir=")]
    _note_folders_before(run_dirs or ["runs/"])  # (the default: runs/<date>_<time>)
    for arg in sys.argv[1:]:
        if arg.startswith("run_dir=") and Path(arg.partition("=")[2]).expanduser().is_file():
            fail(f"{arg}: a file, not a directory; give a directory for the run (new, or one to resume=auto)")
        if arg.startswith("run_dir=") and "$" not in arg:  # (before Hydra makes it)
            try:
                runlock.check_writable(Path(arg.partition("=")[2]).expanduser().absolute())
            except ConfigError as err:
                fail(str(err))
    register_schemas()
    # Let composition errors reach us as exceptions instead of Hydra's multi-line report.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    import yaml

    refusals = (ConfigError, HydraException, OmegaConfBaseException, yaml.YAMLError)
    try:
        with sweep_dir.kept(*refusals):  # a sweep refused before it ran: its dir as it was
            hydra_main()
    except refusals as err:
        _report_refusal(err)
    except SweepFailed as err:  # one line per failed point; the summary has them all
        for line in str(err).splitlines():
            tell(f"xtrain: error: {line}")
        sys.exit(err.exit_code)
    except KeyboardInterrupt:  # before a run started (composing, preparing data)
        tell("xtrain: stopped by Ctrl-C before training started; nothing to continue")
        sys.exit(130)


def unreadable_character(text: str, error: str) -> str:
    """The line for an override Hydra's lexer stops in: the character (its caret's), and how to give it."""
    import unicodedata

    lines = error.splitlines()
    prefix = "LexerNoViableAltException: "
    caret = next((line.index("^") - len(prefix) for line in lines[1:] if line.strip() == "^"), -1)
    at = caret if 0 <= caret < len(text) else next((i for i, c in enumerate(text) if ord(c) > 127), len(text) - 1)
    char = text[at]
    key, _, value = text.partition("=")
    how = ("write the number with the digits 0-9" if unicodedata.category(char) == "Nd" and ord(char) > 127 else
           f"quote the value, e.g. {key}='{value}'")
    return f"{text}: Hydra's override grammar cannot read {char!r} ({unicodedata.name(char, 'U+%04X' % ord(char))}) there; {how}"


def flags_first(argv: list[str], message: str) -> str | None:
    """Where a flag follows an override (argparse then reads the overrides after it as unknown arguments): the hint."""
    unknown = message.partition("unrecognized arguments: ")[2].split()
    if not unknown or any(arg.startswith("-") for arg in unknown):
        return None
    seen_override = False
    for arg in argv:
        if arg.startswith("-") and seen_override:
            return f"flags go before the overrides: move {arg} (and its value) to the front, e.g. python -m xtrain {arg} ..."
        seen_override = seen_override or ("=" in arg and not arg.startswith("-"))
    return None


def arguments(argv: list[str]) -> list[str]:
    """The command line as Hydra reads it, `-m` first (it may come after the overrides); a flag Hydra does not have
    or an override without a setting's name refused in one line (argparse's usage would be eight, Hydra's a
    traceback)."""
    from hydra._internal.utils import get_args_parser

    argv = [a for a in argv if a in ("-m", "--multirun")] + [a for a in argv if a not in ("-m", "--multirun")]
    parser = get_args_parser()
    parser.error = lambda message: fail(f"{message}; {flags_first(argv, message) or 'python -m xtrain --help lists the options'}")
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import RangeSweep

    parsed = parser.parse_args(argv)
    if parsed.multirun and (parsed.cfg or parsed.info):
        fail(f"-m with --{'cfg' if parsed.cfg else 'info'}: Hydra prints one composed config, not a sweep's; drop -m "
             "(a sweep's points, checked and planned: -m ... dry_run=true)")
    try:
        if parsed.config_dir:
            bounds.check_config_dir(parsed.config_dir)
        for text in parsed.overrides:
            bounds.check_override(text)
    except ConfigError as err:
        fail(str(err))
    for text in parsed.overrides:
        if text.lstrip("+~").startswith("="):
            fail(f"{text}: no setting's name before '='; give KEY=VALUE, e.g. trainer.lr=3e-4")
        try:
            [override] = OverridesParser.create().parse_overrides([text])
        except HydraException as err:
            if "LexerNoViableAltException" in str(err):
                fail(unreadable_character(text, str(err)))
            _report_refusal(err)
        study = any(a.startswith("hydra/sweeper=") and "optuna" in a for a in parsed.overrides)  # (its range: stop included)
        if isinstance(override.value(), RangeSweep) and not list(override.sweep_iterator()) and not study:
            fail(f"{text}: the range holds no value (range(start, stop, step) counts from start up to stop, "
                 "without it); a sweep of nothing runs nothing")
    return argv


def _report_refusal(err: Exception) -> None:
    fail(refusal_line(err))


def refusal_line(err: Exception) -> str:
    """The one line a refusal is told in (after `xtrain: error: `)."""
    import yaml

    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, yaml.YAMLError):
        return yaml_error(err)
    if isinstance(err, MissingConfigException):
        return unknown_option(str(err))
    return schema.explained(err)


def yaml_error(err) -> str:
    """A config file that is not YAML, in one line: the file, where, what the parser expected."""
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return f"a config file is not valid YAML: {' '.join(str(err).split())}"
    context = getattr(err, "context", None)
    begun = getattr(err, "context_mark", None)
    where = f" ({context} from line {begun.line + 1})" if context and begun is not None else ""
    return (f"{mark.name}: not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {err.problem}{where}; "
            "fix the file")


def unknown_option(message: str) -> str:
    """Hydra's report of a group option that does not exist (several lines) as one: the option, what was probably
    meant, the choices."""
    import difflib
    import re

    missing = re.search(r"Could not find '([^']+)'", message)
    if not missing or "/" not in missing.group(1):
        return " ".join(message.split("Config search path")[0].split())
    group, _, option = missing.group(1).rpartition("/")
    choices = re.findall(r"^\t(\S+)$", message, re.M)
    close = difflib.get_close_matches(option, choices, n=1, cutoff=0.6)
    listed = ", ".join(choices) if choices else "none"
    hint = f"did you mean {group}={close[0]}? (options: {listed})" if close else f"choose one of {listed}"
    return f"{group}={option}: no such option; {hint}"


if __name__ == "__main__":
    main()
