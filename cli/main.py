"""The `dsv41c` Typer app and its error policy.

Any `DSV41CError` raised by a command becomes one red `error: <message>` line on stderr and
exit code 2; with `DSV41C_DEBUG=1` the exception propagates and its traceback is shown. The
policy lives in the click group's `invoke`, so the console script (`dsv41c.cli.main:app`),
`main()` and `typer.testing.CliRunner` all get it.
"""
from __future__ import annotations

import os
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from dsv41c import __version__
from dsv41c.cli import compile as compile_commands
from dsv41c.cli import export as export_commands
from dsv41c.cli import golden as golden_commands
from dsv41c.cli import kv_budget as kv_budget_commands
from dsv41c.cli import run as run_commands
from dsv41c.errors import DSV41CError

DEBUG_ENV = "DSV41C_DEBUG"
ERROR_EXIT_CODE = 2


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def print_error(message: str) -> None:
    # soft_wrap keeps a long message on one line; Text keeps brackets in it from being read as markup.
    line = " ".join(str(message).split()) or "unknown error"
    Console(stderr=True, highlight=False).print(Text(f"error: {line}", style="bold red"), soft_wrap=True)


class DSV41CGroup(TyperGroup):
    """The command group that turns a dsv41c error into one red line and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DSV41CError as exc:
            if debug_enabled():
                raise
            print_error(str(exc))
            raise typer.Exit(ERROR_EXIT_CODE) from None


app = typer.Typer(
    name="dsv41c",
    cls=DSV41CGroup,
    help="dsv41c: the DeepSeek-V4.1-Flash architecture: an eager PyTorch reference, its compiler and kernels. "
         f"Errors print one red line and exit {ERROR_EXIT_CODE}; set {DEBUG_ENV}=1 for the traceback.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dsv41c {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: Optional[bool] = typer.Option(None, "--version", callback=_print_version, is_eager=True,
                                                help="Print the version and exit.")) -> None:
    """dsv41c: the DeepSeek-V4.1-Flash architecture: an eager PyTorch reference, its compiler and kernels."""


run_commands.register(app)
kv_budget_commands.register(app)
golden_commands.register(app)
compile_commands.register(app)
export_commands.register(app)


def main() -> None:
    app(prog_name="dsv41c")


if __name__ == "__main__":
    main()
