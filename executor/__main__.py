"""``python -m executor run ARGS`` = ``autopar run ARGS``, ``python -m executor tune ARGS`` = ``autopar tune ARGS``.

Registered here, not only through the ``autopar.commands`` entry points, so they also run from a checkout that
was never pip-installed (a GPU machine's own Python with the repository on ``PYTHONPATH``); ``autopar tune``
launches each run so."""

from executor.cli import run
from executor.tune import tune
from planner import cli

if __name__ == "__main__":
    cli.app.command(name="run")(run)
    cli.app.command(name="tune")(tune)
    cli.main()
