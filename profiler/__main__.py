"""``python -m profiler ARGS`` = ``autopar profile ARGS`` (handy under ``torchrun -m profiler``).

The command is registered here, not only through the ``autopar.commands`` entry point, so it also
runs from a checkout that was never pip-installed (a GPU machine's own Python with the repository
on ``PYTHONPATH``)."""

import sys

from planner import cli
from profiler.cli import profile

if __name__ == "__main__":
    cli.app.command(name="profile")(profile)
    sys.argv[1:1] = ["profile"]
    cli.main()
