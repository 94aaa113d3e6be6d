"""`python -m minisgl.bench ...`: the same as `python -m minisgl bench ...` (`minisgl-run bench`).

An entry point at the top of the import layers, beside the command line (tests/test_layers.py puts it
in the entry layer): it imports the command line, which imports the offline benchmark
(`minisgl.bench.offline`); nothing in `minisgl.bench` imports this file or the command line.
"""

import sys

from minisgl.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
