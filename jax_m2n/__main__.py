"""`python -m jax_m2n`: the command line (see jax_m2n/_src/cli.py)."""

import sys

from jax_m2n._src.cli import main

if __name__ == "__main__":
  sys.exit(main())
