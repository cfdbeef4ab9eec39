"""Command-line front of the Hydra entry points: a bad config is reported whole.

Hydra stops at the first config-group option it cannot find (`cache=pagd`) before any
other check can run. `precheck` finds every such option first, composes the config
without them, runs the entry point's own checks on the rest, and prints all reasons
together (exit 2, no traceback), all before any weights load.
"""

from __future__ import annotations

import sys
from typing import Callable

from models.errors import SetupError
from models.loading import CONF_DIR


def group_options(group: str) -> list[str]:
    """The options of a config group: the yaml files in conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def split_choices(argv: list[str]) -> tuple[list[str], list[str]]:
    """(reasons for group options that do not exist, the overrides without them); a
    sweep list (`cache=dense,pagd`) is checked value by value; its first value is kept."""
    reasons, kept = [], []
    for arg in argv:
        key, eq, value = arg.partition("=")
        group = key.lstrip("+~")
        if arg.startswith("-") or not eq or "." in group or not (CONF_DIR / group).is_dir():
            kept.append(arg)
            continue
        names = group_options(group)
        bad = [v for v in value.split(",") if v and v != "null" and v not in names]
        if bad:
            reasons += [f"{group}={v}: no such {group}; the options are {', '.join(names)}" for v in bad]
        else:
            kept.append(f"{key}={value.split(',')[0]}")
    return reasons, kept


def _first_value(arg: str) -> str:
    """`key=a,b` (a sweep) -> `key=a`; lists, dicts and quoted values stay whole."""
    key, _, value = arg.partition("=")
    if "," in value and value[:1] not in "[{'\"":
        value = value.split(",")[0]
    return f"{key}={value}"


def precheck(argv: list[str], config_name: str, check: Callable) -> None:
    """Exit 2 with every reason when a group option is unknown (see the module doc)."""
    reasons, kept = split_choices(argv)
    if not reasons:
        return  # Hydra composes; the entry point's own check lists the rest
    from hydra import compose, initialize_config_dir

    overrides = [_first_value(a) for a in kept if not a.startswith("-") and not a.startswith("hydra")]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            check(compose(config_name=config_name, overrides=overrides))
    except SetupError as e:
        reasons += e.reasons
    except Exception as e:  # the rest of the config does not compose either
        reasons.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    print(f"error: {SetupError(reasons)}", file=sys.stderr)
    sys.exit(2)
