"""Where decodelab keeps what it makes once and reuses (converted weights, the native
kernels, compiled graphs, prepared data sets). Imports nothing of decodelab's, so that any
module can use it without an import circle."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$DECODELAB_CACHE, else ~/.cache/decodelab (read at each call: a test or a script may
    set it after import)."""
    return Path(os.environ.get("DECODELAB_CACHE", Path.home() / ".cache" / "decodelab"))
