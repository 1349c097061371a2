"""`python -m zoo` (what `torchrun -m zoo ...` runs)."""

import sys

from zoo.cli import main

sys.exit(main())
