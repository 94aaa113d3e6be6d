"""`python -m minisgl.bench ...`: the same as `python -m minisgl bench ...` (`minisgl-run bench`).

An entry point at the top of the import layers: it imports the command line, which imports the
benchmark library (`minisgl.bench`), so the library never imports the command line.
"""

import sys

from minisgl.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
