"""``python -m qkvtrace.cli``."""

import sys

from qkvtrace.cli.main import main

sys.exit(main())
