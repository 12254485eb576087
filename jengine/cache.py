"""Where jengine keeps the files it generates: the tiny model (`<root>/tiny-v1`) and JAX's
persistent compilation cache (`<root>/jax`).

`$JENGINE_CACHE_DIR` if set, else `$XDG_CACHE_HOME/jengine`, else `~/.cache/jengine`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    override = os.environ.get("JENGINE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "jengine"
