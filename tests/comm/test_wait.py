"""The stall monitor warns once about a blocking wait that outlives its limit, and never about a quick one."""

from __future__ import annotations

import time
import warnings

from mpitrain._utils.stall import watched


def test_a_long_wait_warns_once_naming_label_and_detail():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watched("ring_allreduce", "waiting for rank 1", warn_after=0.2):
            time.sleep(2.5)  # the monitor wakes once a second: two wake-ups past the limit
        with watched("halo exchange", "quick", warn_after=30.0):
            pass
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages == ["ring_allreduce stalled for 0.2 s; waiting for rank 1"], messages
