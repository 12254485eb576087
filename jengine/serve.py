"""`python -m jengine.serve [options]`: the same as `jengine serve` (see jengine/server/cli.py)."""

import sys

from jengine.server.cli import run

if __name__ == "__main__":
    sys.exit(run())
