from __future__ import annotations

import os

# Every collective of every distributed test checks its tensors' devices against the backend.
os.environ.setdefault("ZOO_CHECK_COLLECTIVES", "1")
