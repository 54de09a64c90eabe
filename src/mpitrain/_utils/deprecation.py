"""Old option names that keep working for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["renamed_options"]

V = TypeVar("V")


def renamed_options(options: Mapping[str, V], aliases: Mapping[str, str], where: str, *,
                    stacklevel: int = 3) -> dict[str, V]:
    """A copy of `options` with every deprecated name (a key of `aliases`) replaced by its new name.

    Each old name used gives one DeprecationWarning "<where>: option 'old' is deprecated; use 'new'"
    (attributed `stacklevel` frames up: by default the caller of the function that calls this one).
    Two spellings of one option (old and new, or two old ones) raise TypeError, as a keyword given
    twice does. The order of the other options is kept."""
    out: dict[str, V] = {}
    given: dict[str, str] = {}  # new name -> the spelling that set it
    for key, value in options.items():
        new = aliases.get(key, key)
        if new in given:
            raise TypeError(f"{where}: option {new!r} given twice (as {given[new]!r} and {key!r})")
        if new != key:
            warnings.warn(f"{where}: option {key!r} is deprecated; use {new!r}", DeprecationWarning,
                          stacklevel=stacklevel)
        given[new] = key
        out[new] = value
    return out
