"""``python -m pace_core``: see :mod:`pace_core.cli`."""

import sys

from pace_core.cli import main

if __name__ == "__main__":
    sys.exit(main())
