"""``python -m mpitrain`` is the ``mpitrain`` command."""

import sys

from .cli import main

sys.exit(main())
