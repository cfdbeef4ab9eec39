"""The one error type for bad setups and bad inputs.

Every check that can fail before expensive work starts collects *all* of its reasons
and raises one `SetupError`, so a user fixes everything in one go.
"""

from __future__ import annotations


class SetupError(ValueError):
    """A setup or an input that cannot work; `reasons` lists every problem found."""

    def __init__(self, reasons: list[str] | str):
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        lines = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"invalid setup ({len(self.reasons)} problem(s)):\n{lines}")


def raise_if(reasons: list[str]) -> None:
    """Raise one SetupError listing every reason, if there is any."""
    if reasons:
        raise SetupError(reasons)


class PoolExhausted(SetupError):
    """A KV pool with too few free blocks for a forward (raised with the cache unchanged):
    a serving engine preempts a request and retries; elsewhere it is a setup error."""


def shown(value, width: int = 80) -> str:
    """`value` as an error message quotes it: its repr (cut at `width` characters) and its
    type, `'0.5' (a str)`, `123 (an int)`."""
    kind = type(value).__name__
    return f"{repr(value)[:width]} ({'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind})"
