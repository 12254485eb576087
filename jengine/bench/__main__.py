"""The child process of `jengine bench` (one part, one --numerics): python -m jengine.bench."""

import sys

from jengine.bench import _child_main

sys.exit(_child_main(sys.argv[1:]))
