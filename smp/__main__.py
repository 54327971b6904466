"""`python -m smp ...` is the `smp` command (for environments where the script is not on PATH)."""

import sys

from smp.cli import main

sys.exit(main())
