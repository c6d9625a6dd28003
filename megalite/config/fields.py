"""A documented, bounded config field (`arg`) and the check every config section runs on
construction (`Section`): finite numbers within the bounds their fields declare, so a zero
never reaches a division.
"""
import dataclasses
import math
from dataclasses import field


def arg(default, help: str, aliases: tuple[str, ...] = (), choices=None, min=None, above=None,
        below=None, **kw):
    """A dataclass field documented for the generated command line. Numeric bounds: `min`
    (value >= min), `above` (value > above), `below` (value < below); None is always allowed."""
    factory = {"default_factory": default} if callable(default) else {"default": default}
    bounds = {"min": min, "above": above, "below": below}
    return field(metadata={"help": help, "aliases": aliases, "choices": choices, **bounds, **kw},
                 **factory)


def check_range(f: dataclasses.Field, value) -> None:
    """ValueError (one line naming the flag) if a numeric field's value is not finite or
    outside the bounds `arg` declared for it."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    flag, meta = "--" + f.name.replace("_", "-"), f.metadata
    if not math.isfinite(value):
        raise ValueError(f"{flag} ({value}) must be a finite number")
    if meta.get("min") is not None and value < meta["min"]:
        raise ValueError(f"{flag} ({value}) must be >= {meta['min']}")
    if meta.get("above") is not None and value <= meta["above"]:
        raise ValueError(f"{flag} ({value}) must be > {meta['above']}")
    if meta.get("below") is not None and value >= meta["below"]:
        raise ValueError(f"{flag} ({value}) must be < {meta['below']}")


class Section:
    """Base of the config dataclasses: constructing one checks every field's range (before
    a subclass's own rules, which call super().__post_init__() first)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_range(f, getattr(self, f.name))
