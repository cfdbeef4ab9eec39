"""Command-line front of the Hydra entry points: a bad config is reported whole.

Hydra stops at the first config-group option it cannot find (`cache=pagd`) or key it
does not know (`decoder.temprature=0.5`), before any other check can run. `precheck`
finds every such override first (with the close matches), composes the config without
them, runs the entry point's own checks on the rest, and prints all reasons together
(exit 2, no traceback), all before any weights load.
"""

from __future__ import annotations

import sys
from typing import Callable

from omegaconf import OmegaConf

from decodelab.experiments.harness import group_options
from decodelab.models.errors import SetupError
from decodelab.models.loading import CONF_DIR


#: Hydra's flags that print and exit (`--cfg job`, `--info defaults`, `--shell-completion
#: install=bash`: the word after one is not a setting) or that take configs from elsewhere
#: (`--config-dir`): with one, the command line goes to Hydra as it is, and the entry
#: point's own check still runs on the composed config before any weights load
HYDRA_AS_IS = ("--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i", "--shell-completion",
               "-sc", "--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun",
               "--package", "-p", "--resolve")


def as_is(argv: list[str]) -> bool:
    """Whether the command line goes to Hydra unchecked (`HYDRA_AS_IS`, `hydra.searchpath`)."""
    return any(a.partition("=")[0] in HYDRA_AS_IS or a.startswith("hydra.searchpath") for a in argv)


def _sweep_function(value: str) -> bool:
    """`choice(dense,paged)`, `range(1,4)`, `glob(*)`, ...: a Hydra sweep, expanded by Hydra."""
    return "(" in value and value.rstrip().endswith(")")


def _choices(value: str) -> list[str] | None:
    """The options of a `choice(a,b)` sweep (quotes stripped); None for any other value."""
    if not (_sweep_function(value) and value.startswith("choice(")):
        return None
    return [v.strip(" '\"") for v in value[len("choice("):value.rindex(")")].split(",")]


def split_choices(argv: list[str]) -> tuple[list[str], list[str]]:
    """(reasons for group options that do not exist, the overrides without them); a
    sweep list (`cache=dense,pagd`) is checked value by value; its first value is kept."""
    reasons, kept = [], []
    for arg in argv:
        key, eq, value = arg.partition("=")
        group = _group(key) if eq and not arg.startswith("-") else None
        names = group_options(group) if group else []
        if _sweep_function(value):  # Hydra expands it; a choice() of group options is checked here
            bad = [v for v in _choices(value) or [] if group and v and v not in names]
            reasons += [f"{key.lstrip('+~')}={v}: no such {group}; the options are {', '.join(names)}" for v in bad]
            kept += [] if bad else [arg]
            continue
        bad = [v for v in value.split(",") if group and v and v != "null" and v not in names]
        reasons += [f"{key.lstrip('+~')}={v}: no such {group}; the options are {', '.join(names)}" for v in bad]
        if not bad:
            kept.append(f"{key}={value.split(',')[0]}" if group else arg)
    return reasons, kept


def _group(key: str) -> str | None:
    """The config group an override key selects (`cache`, `+cache`, `model@draft.model`:
    a group placed at another package), or None."""
    group = key.lstrip("+~").split("@")[0]
    return group if "." not in group and (CONF_DIR / group).is_dir() else None


def _first_value(arg: str) -> str:
    """`key=a,b` (a sweep) -> `key=a`; lists, dicts and quoted values stay whole."""
    key, _, value = arg.partition("=")
    if "," in value and value[:1] not in "[{'\"":
        value = value.split(",")[0]
    return f"{key}={value}"


def unknown_keys(cfg, argv: list[str]) -> tuple[list[str], list[str]]:
    """(reasons for `a.b=v` overrides whose key the composed config lacks, the rest)."""
    import difflib

    reasons, kept = [], []
    for arg in argv:
        key = arg.partition("=")[0]
        if (arg.startswith(("-", "+", "~", "hydra")) or "=" not in arg or _group(key)
                or has_key(cfg, key)):
            kept.append(arg)
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        known = list(node.keys()) if hasattr(node, "keys") else []
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close else \
            f"the keys there are {', '.join(map(str, known))}" if known else "no such key"
        reasons.append(f"{key}: unknown config key; {hint} (to add a new key on purpose: +{arg})")
    return reasons, kept


def as_lists(cfg, argv: list[str]) -> list[str]:
    """`key=v` where `key` of the composed config `cfg` holds a list and v is one value:
    `key=[v]`, a one-element list (`rates=2` -> `rates=[2]`); a sweep of single values
    (`-m rates=1,2`) sweeps one-element lists (`rates=[1],[2]`). Lists, dicts, sweep
    functions (`choice(...)`), null and added or deleted keys stay as written."""
    from omegaconf import ListConfig

    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        items = _plain_items(value)
        if eq and items and not arg.startswith(("-", "+", "~", "hydra")) and has_key(cfg, key) \
                and isinstance(OmegaConf.select(cfg, key), ListConfig):
            arg = f"{key}={','.join(f'[{v}]' for v in items)}"
        out.append(arg)
    return out


def _plain_items(value: str) -> list[str] | None:
    """The values of `value` where it is one plain value or a sweep of plain ones (`2`, `1,inf`,
    one quoted string); None for anything else, which stays as written: lists, dicts, null,
    sweep functions, interpolations (`${...}`), escapes, quoted sweeps."""
    if not value or value[:1] in "[{" or value == "null" or "(" in value or "${" in value or "\\" in value:
        return None
    if value[:1] in "'\"":  # one quoted string, or a sweep of them (left to Hydra)
        return [value] if value.count(value[0]) == 2 and value.endswith(value[0]) else None
    return None if "'" in value or '"' in value else value.split(",")


def has_key(cfg, key: str) -> bool:
    """Whether the composed config `cfg` (None: no config) has the dotted `key`."""
    return cfg is not None and OmegaConf.select(cfg, key, default=has_key) is not has_key


def precheck(argv: list[str], config_name: str, check: Callable) -> list[str]:
    """Exit 2 with every reason when a group option or a key is unknown (see the module
    doc); otherwise return the command line for Hydra (`as_lists`)."""
    from hydra import compose, initialize_config_dir

    if as_is(argv):
        return argv
    reasons, kept = split_choices(argv)
    overrides, free = [], set()  # free: groups swept by glob() & co (their keys are not checked here)
    for a in kept:
        key, _, value = a.partition("=")
        if a.startswith(("-", "hydra")):
            continue
        if not _sweep_function(value):
            overrides.append(_first_value(a))
        elif _group(key) and _choices(value):  # composed with its first option
            overrides.append(f"{key}={_choices(value)[0]}")
        elif _group(key):
            free.add(_group(key))
    groups = [a for a in overrides if _group(a.partition("=")[0])]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            base = compose(config_name=config_name, overrides=groups)
            unfree = [a for a in overrides if a.lstrip("+~").split(".")[0] not in free]
            more, overrides = unknown_keys(base, as_lists(base, unfree))
            reasons += more
            if not reasons:
                return as_lists(base, argv)  # Hydra composes; the entry point's own check lists the rest
            check(compose(config_name=config_name, overrides=overrides))
    except SetupError as e:
        reasons += e.reasons
    except Exception as e:  # the rest of the config does not compose either
        reasons.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    if reasons:
        print(f"error: {SetupError(reasons)}", file=sys.stderr)
        sys.exit(2)
