"""The public API listed in mpitrain.__all__ resolves, and `mpitrain.fit` stays the function."""

from __future__ import annotations

import subprocess
import sys


def test_every_public_name_resolves():
    import mpitrain

    missing = [n for n in mpitrain.__all__ if getattr(mpitrain, n, None) is None]
    assert not missing, missing


def test_fit_is_the_function_even_after_importing_the_submodule():
    code = ("import mpitrain.fit, mpitrain.strategies.pipeline, mpitrain; "
            "assert callable(mpitrain.fit) and mpitrain.fit.__module__ == 'mpitrain.fit', mpitrain.fit")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
