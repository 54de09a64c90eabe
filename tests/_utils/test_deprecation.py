"""renamed_options: old option names map to new ones with a DeprecationWarning."""

import pytest

from mpitrain._utils.deprecation import renamed_options


def test_old_name_maps_to_new_name_with_a_warning():
    given = {"stall_timeout": 5.0, "other": 1}
    with pytest.warns(DeprecationWarning, match="'stall_timeout' is deprecated.*'warn_after'"):
        out = renamed_options(given, {"stall_timeout": "warn_after"}, "kvstore.create")
    assert out == {"warn_after": 5.0, "other": 1}
    assert given == {"stall_timeout": 5.0, "other": 1}


def test_new_names_pass_without_warning(recwarn):
    assert renamed_options({"warn_after": 2.0}, {"stall_timeout": "warn_after"}, "x") == {"warn_after": 2.0}
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_both_names_at_once_is_an_error():
    with pytest.raises(TypeError, match="give only 'warn_after'"):
        renamed_options({"stall_timeout": 1.0, "warn_after": 2.0}, {"stall_timeout": "warn_after"}, "x")
