"""``python -m profiler ARGS`` = ``autopar profile ARGS`` (handy under ``torchrun -m profiler``)."""

import sys

from planner.cli import main

if __name__ == "__main__":
    sys.argv[1:1] = ["profile"]
    main()
