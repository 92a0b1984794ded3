"""`python -m flashgen`: the CLI, for checkouts run from PYTHONPATH without the console script."""

from flashgen.cli import app

app(prog_name="flashgen")
