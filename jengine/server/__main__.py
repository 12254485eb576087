"""`python -m jengine.server`: the same as `jengine serve` and `python -m jengine.serve`."""

import sys

from jengine.server.cli import run

if __name__ == "__main__":
    sys.exit(run())
