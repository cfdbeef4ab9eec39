"""Command-line front of the Hydra entry points: a bad config is reported whole.

Hydra stops at the first config-group option it cannot find (`cache=pagd`) or key it
does not know (`decoder.temprature=0.5`), before any other check can run. `precheck`
parses the command line with Hydra's own override parser (its grammar: sweeps,
`choice()`, `glob()`, `range()`, `+`/`++`/`~`, `group@package`, quoting and escapes), finds
every unknown group option and every key the composed config lacks (with the close
matches), composes the config without them, runs the entry point's own checks on that
composed config, and prints all reasons together (exit 2, no traceback), all before any
weights load. A sweep is checked option by option: a key is checked against every
option of a swept group. Configs of the user's own (`--config-dir DIR`,
`hydra.searchpath=[file://DIR]`) are composed and checked with the packaged ones.
"""

from __future__ import annotations

import difflib
import functools
import sys
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR, config_options

#: Hydra's flags that print and exit (`--cfg job`, `--info defaults`, `--shell-completion
#: install=bash`: the word after one is not a setting) or that choose another primary
#: config: with one, the command line goes to Hydra as it is (the entry point's own check
#: still runs on the composed config before any weights load)
HYDRA_AS_IS = ("--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i", "--shell-completion",
               "-sc", "--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun", "--package", "-p",
               "--resolve")
#: Hydra's flags whose value may come as the next word (`--cfg job`, `-cd DIR`)
VALUE_FLAGS = ("--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--config-dir", "-cd", "--config-path",
               "-cp", "--config-name", "-cn", "--experimental-rerun", "--package", "-p")
CONFIG_DIR_FLAGS = ("--config-dir", "-cd")  # a folder of the user's configs, searched beside the packaged ones


def as_is(argv: list[str]) -> bool:
    """Whether the command line goes to Hydra unchecked (`HYDRA_AS_IS`)."""
    return any(a.partition("=")[0] in HYDRA_AS_IS for a in argv)


@functools.cache
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides of a command line, the config folders its `--config-dir` flags name);
    `-m` and other flags are neither."""
    overrides, dirs, it = [], [], iter(argv)
    for a in it:
        flag, eq, value = a.partition("=")
        if flag in CONFIG_DIR_FLAGS:
            dirs.append(value if eq else next(it, ""))
        elif not a.startswith("-"):
            overrides.append(a)
    return overrides, dirs


def search_path(dirs: list[str], overrides) -> list[str]:
    """`hydra.searchpath` entries for composing: `--config-dir` folders, then the command
    line's own `hydra.searchpath`."""
    path = [f"file://{Path(d).resolve()}" for d in dirs if d]
    for o in overrides:
        if o.key_or_group == "hydra.searchpath" and isinstance(o.value(), list):
            path += [str(v) for v in o.value()]
    return path


def _config_dirs(path: list[str]) -> list[Path]:
    return [CONF_DIR, *(Path(p.removeprefix("file://")) for p in path if p.startswith("file://"))]


def group_options(group: str, path: list[str] = ()) -> list[str]:
    """The options of a config group: its yaml files, packaged (`config_options`) and in
    the search path."""
    return sorted({*config_options(group), *(f.stem for d in _config_dirs(list(path))[1:]
                                             for f in (d / group).glob("*.yaml"))})


def _group(key: str, path: list[str] = ()) -> str | None:
    """The config group an override key selects (`cache`, `+cache`, `model@draft.model`:
    a group placed at another package), or None."""
    group = key.lstrip("+~").split("@")[0]
    return group if "." not in group and any((d / group).is_dir() for d in _config_dirs(list(path))) else None


def _values(o, names: list[str]) -> list[str]:
    """The option names an override of a group asks for, in order (a glob: the matching ones)."""
    from hydra.core.override_parser.types import Glob, ValueType

    if o.is_delete():
        return []
    if o.value() is None:
        return ["null"]  # no config of the group
    if o.value_type == ValueType.GLOB_CHOICE_SWEEP and isinstance(o.value(), Glob):
        return o.value().filter(names)
    if o.is_sweep_override():
        return [v.strip("'\"") for v in o.sweep_string_iterator()]
    return [str(o.value())]


def group_choices(overrides, path: list[str] = ()) -> tuple[list[str], dict]:
    """(reasons for group options that do not exist, {override of a group: its valid
    options in order}, by the override's index); `null` is an option (no config of the
    group), a deletion has none."""
    reasons, chosen = [], {}
    for i, o in enumerate(overrides):
        group = _group(o.key_or_group, path)
        if group is None:
            continue
        names = group_options(group, path)
        values = _values(o, names)
        bad = [v for v in values if v not in names and v != "null"]
        reasons += [f"{o.key_or_group}={v}: no such {group}; the options are {', '.join(names)}" for v in bad]
        if o.value_type is not None and o.value_type.name == "RANGE_SWEEP":
            reasons.append(f"{o.input_line}: a range() of {group} options; name them: {o.key_or_group}=a,b")
        chosen[i] = [v for v in values if v not in bad]
    return reasons, chosen


def _as(o, option: str | None = None) -> str:
    """A group's override with one option (`cache=a,b` -> `cache=a`); a deletion as written."""
    return o.input_line if o.is_delete() else f"{o.get_key_element()}={option}"


def _under(o) -> str:
    """The key prefix a group's override configures (`cache.`, `draft.model.` for `model@draft.model`)."""
    return f"{o.package or o.key_or_group.lstrip('+~')}."


def _first_options(overrides, chosen: dict) -> dict[int, str]:
    """{index: the group's override with its first good option} (a deletion as written);
    a group override with no good option is left out."""
    return {i: _as(overrides[i], (v or [None])[0]) for i, v in chosen.items() if v or overrides[i].is_delete()}


def _read(argv: list[str]) -> tuple[list, list[str], list[str], dict]:
    """A command line through Hydra's parser: (overrides, the search path of its existing
    config folders, reasons so far, `group_choices`'s options); raises Hydra's
    OverrideParseException for text its grammar refuses."""
    texts, dirs = split_argv(argv)
    overrides = _parser().parse_overrides(texts)
    path = search_path(dirs, overrides)
    reasons, chosen = group_choices(overrides, path)
    missing = [p for p in path if p.startswith("file://") and not Path(p.removeprefix("file://")).is_dir()]
    reasons += [f"config folder {p.removeprefix('file://')} (--config-dir or hydra.searchpath) is not a directory; "
                "give the folder that holds your group folders (model/, cache/, ...)" for p in missing]
    return overrides, [p for p in path if p not in missing], reasons, chosen


def split_choices(argv: list[str]) -> tuple[list[str], list[str]]:
    """(reasons for group options that do not exist, the command line's overrides without
    them, each sweep of a group reduced to its first good option); an override Hydra's
    parser refuses is a reason of its own."""
    try:
        overrides, _, reasons, chosen = _read(argv)
    except Exception as e:  # hydra.errors.OverrideParseException: the grammar's own message
        return [str(e).splitlines()[0]], []
    firsts = _first_options(overrides, chosen)
    return reasons, [firsts.get(i, o.input_line) for i, o in enumerate(overrides) if i not in chosen or i in firsts]


def _first(o) -> str:
    """An override with a sweep reduced to its first value (`key=a,b` -> `key=a`)."""
    if not o.is_sweep_override():
        return o.input_line
    from hydra.core.override_parser.types import ValueType

    if o.value_type == ValueType.GLOB_CHOICE_SWEEP:
        return ""  # a glob over a key's values has no first value without its options
    return f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"


def unknown_keys(cfg, argv: list[str], where: str = "") -> tuple[list[str], list[str]]:
    """(reasons for `a.b=v` overrides whose key the composed config lacks, the rest);
    `where` says which swept option lacks it."""
    reasons, kept = [], []
    for arg in argv:
        key = arg.partition("=")[0]
        if (arg.startswith(("-", "+", "~", "hydra")) or "=" not in arg or _group(key) or has_key(cfg, key)):
            kept.append(arg)
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        known = list(node.keys()) if hasattr(node, "keys") else []
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else \
            f"the keys there are {', '.join(map(str, known))}" if known else "no such key"
        reasons.append(f"{key}: unknown config key{where}; {hint} (to add a new key on purpose: +{arg})")
    return reasons, kept


def as_lists(cfg, argv: list[str]) -> list[str]:
    """`key=v` where `key` of the composed config `cfg` holds a list and v is one value:
    `key=[v]`, a one-element list (`rates=2` -> `rates=[2]`); a sweep of single values
    (`-m rates=1,2`) sweeps one-element lists (`rates=[1],[2]`). Lists, dicts, sweep
    functions (`choice(...)`), null, interpolations, escapes, quoted sweeps and added or
    deleted keys stay as written."""
    from omegaconf import ListConfig

    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        items = _plain_items(arg)
        if eq and items and not arg.startswith(("-", "+", "~", "hydra")) and has_key(cfg, key) \
                and isinstance(OmegaConf.select(cfg, key), ListConfig):
            arg = f"{key}={','.join(f'[{v}]' for v in items)}"
        out.append(arg)
    return out


def _plain_items(arg: str) -> list[str] | None:
    """The values of an override as Hydra parses it where it is one plain value or a plain
    sweep (`2`, `1,inf`, one quoted string); None for anything else: lists, dicts, null,
    sweep functions, interpolations, escapes, quoted sweeps, text Hydra refuses."""
    from hydra.core.override_parser.types import ValueType

    value = arg.partition("=")[2]
    try:
        (o,) = _parser().parse_overrides([arg])
    except Exception:
        return None  # Hydra reports it
    if "\\" in value or "${" in value:
        return None
    if o.value_type == ValueType.ELEMENT:
        return [value] if isinstance(o.value(), (str, int, float)) else None  # (bool is an int)
    if o.value_type == ValueType.SIMPLE_CHOICE_SWEEP and "'" not in value and '"' not in value:
        return [str(v) for v in o.sweep_string_iterator()]
    return None


def has_key(cfg, key: str) -> bool:
    """Whether the composed config `cfg` (None: no config) has the dotted `key`."""
    return cfg is not None and OmegaConf.select(cfg, key, default=has_key) is not has_key


def precheck(argv: list[str], config_name: str, check: Callable) -> list[str]:
    """Exit 2 with every reason when a group option or a key is unknown, or when the entry
    point's `check` refuses the composed config (see the module doc); otherwise return the
    command line for Hydra (`as_lists`)."""
    if as_is(argv):
        return argv
    try:
        overrides, path, reasons, chosen = _read(argv)
    except Exception as e:  # hydra.errors.OverrideParseException
        return _refuse([str(e).splitlines()[0]])
    extra = [f"hydra.searchpath=[{','.join(path)}]"] if path else []
    groups = _first_options(overrides, chosen)
    rest = [a for a in (_first(o) for i, o in enumerate(overrides)
                        if i not in chosen and not o.key_or_group.startswith("hydra.")) if a]
    try:
        base = _compose(config_name, [*extra, *groups.values()])
        swept = [i for i, options in chosen.items() if len(options) > 1]
        rest = as_lists(base, rest)
        under = {i: [a for a in rest if a.partition("=")[0].startswith(_under(overrides[i]))] for i in swept}
        more, kept = unknown_keys(base, [a for a in rest if not any(a in u for u in under.values())])
        reasons += more
        for i in swept:  # a key under a swept group: checked against each of its options
            o, found = overrides[i], set()
            for option in chosen[i]:
                alt = _compose(config_name, [*extra, *[g for j, g in groups.items() if j != i], _as(o, option)])
                bad, _ = unknown_keys(alt, under[i], f" for {_as(o, option)}")
                reasons += bad
                found |= {r.partition(":")[0] for r in bad}
            kept += [a for a in under[i] if a.partition("=")[0] not in found]
        if not reasons:
            return as_lists(base, argv)  # Hydra composes; the entry point's own check lists the rest
        check(_compose(config_name, [*extra, *groups.values(), *kept]))
    except SetupError as e:
        reasons += e.reasons
    except Exception as e:  # the rest of the config does not compose either
        reasons.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    return _refuse(reasons)


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def _refuse(reasons: list[str]):
    print(f"error: {SetupError(reasons)}", file=sys.stderr)
    sys.exit(2)
