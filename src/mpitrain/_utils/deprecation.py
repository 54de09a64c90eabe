"""Renamed options: the old name keeps working for one release, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["renamed_options"]


def renamed_options(options: dict[str, Any], aliases: dict[str, str], where: str) -> dict[str, Any]:
    """A copy of `options` with every old name in `aliases` (old -> new) replaced by its new name,
    warning once per old name used (DeprecationWarning naming `where`, e.g. ``"kvstore.create"``).

    Raises TypeError if an option is given under both its old and its new name. `options` is not
    changed; names not in `aliases` pass through."""
    out = dict(options)
    for old, new in aliases.items():
        if old not in out:
            continue
        if new in out:
            raise TypeError(f"{where}: option {old!r} was renamed {new!r}; give only {new!r}, not both")
        warnings.warn(f"{where}: option {old!r} is deprecated and will be removed in the next release; "
                      f"use {new!r}", DeprecationWarning, stacklevel=3)
        out[new] = out.pop(old)
    return out
