"""`python -m minisgl ...`: the `minisgl-run` command line (generate, bench, config)."""

from minisgl.cli import main

if __name__ == "__main__":
    main()
