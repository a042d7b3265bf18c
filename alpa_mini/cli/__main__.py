"""``python -m alpa_mini.cli``: the ``alpa-mini`` command."""

import sys

from .main import main

sys.exit(main())
