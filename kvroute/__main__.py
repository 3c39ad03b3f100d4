"""`python -m kvroute`: the same as the `kvroute` command."""

import sys

from kvroute.cli import main

if __name__ == "__main__":  # vLLM spawns processes that re-import the main module
    sys.exit(main())
