"""What the command line and a config folder may hold before Hydra reads them: names a filesystem can take, and YAML
whose aliases do not expand past `NODE_LIMIT` nodes (a few hundred bytes of nested aliases are a billion)."""

from __future__ import annotations

from pathlib import Path

from xtrain.core.errors import ConfigError

NODE_LIMIT = 100_000  # nodes of one config file with its aliases expanded (xtrain's largest has a few hundred)
NAME_MAX = 255  # bytes of one file or folder name (ext4, xfs, NFS)
KEY_MAX = 200  # characters of a setting's name


def _shown(text: str) -> str:
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def check_override(text: str) -> None:
    """A setting's name, a config option's name and each folder of run_dir within what a filesystem can take."""
    key, sep, value = text.partition("=")
    if len(key) > KEY_MAX:
        raise ConfigError(f"{_shown(key)}: not a setting (a name of {len(key)} characters); "
                          "python -m xtrain --cfg job lists every setting")
    if not sep:
        return
    if key.lstrip("+~") == "run_dir":
        for part in Path(value).parts:
            if len(part.encode()) > NAME_MAX:
                raise ConfigError(f"run_dir={_shown(value)}: its folder name {_shown(part)} is {len(part.encode())} "
                                  f"bytes, more than a filesystem takes ({NAME_MAX}); give a shorter run_dir")
    elif "." not in key and len(value.encode()) > NAME_MAX and not value.lstrip().startswith(("[", "{")):
        raise ConfigError(f"{key}={_shown(value)}: not an option of {key} (a name of {len(value)} characters); "
                          f"python -m xtrain --help lists the options")


def expanded_size(node, limit: int = NODE_LIMIT) -> int:
    """The nodes of a composed YAML node with its aliases expanded (an alias is the same node object), counted once
    per node object; stops counting past `limit`."""
    from yaml.nodes import MappingNode, SequenceNode

    sizes: dict[int, int] = {}
    open_ = set()  # nodes whose children are being counted: one met again is an alias to itself, with no end
    stack = [(node, False)]
    while stack:
        current, children_done = stack.pop()
        if id(current) in sizes:
            continue
        if not children_done and id(current) in open_:
            return limit + 1
        if isinstance(current, MappingNode):
            children = [n for pair in current.value for n in pair]
        elif isinstance(current, SequenceNode):
            children = list(current.value)
        else:
            children = []
        if children_done or not children:
            sizes[id(current)] = min(limit + 1, 1 + sum(sizes[id(c)] for c in children))
            open_.discard(id(current))
            continue
        open_.add(id(current))
        stack.append((current, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(node)]


def check_config_dir(folder: str) -> None:
    """Every YAML file of a `--config-dir` composes to at most `NODE_LIMIT` nodes, its aliases expanded."""
    import yaml

    root = Path(folder).expanduser()
    if not root.is_dir():
        return  # (Hydra says so)
    for file in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
        try:
            with open(file, "rb") as f:
                nodes = list(yaml.compose_all(f, Loader=yaml.SafeLoader))
        except (yaml.YAMLError, OSError, UnicodeDecodeError):
            continue  # (Hydra reports what it cannot read, naming the file)
        except RecursionError:
            raise ConfigError(f"--config-dir {folder}: {file} is nested deeper than a config is read; "
                              "write it flatter, or remove it") from None
        for node in nodes:
            if node is not None and expanded_size(node) > NODE_LIMIT:
                raise ConfigError(f"--config-dir {folder}: {file} expands to more than {NODE_LIMIT:,} nodes (aliases "
                                  "that repeat aliases); a config file is refused past that: write it out, or remove it")
