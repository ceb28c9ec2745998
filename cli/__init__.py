"""The `dsv41c` command line: a Typer app (`dsv41c.cli.main:app`), one module per command group."""
