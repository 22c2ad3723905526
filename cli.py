"""The ``kvflow`` command line: thin wrappers over the library.

User errors exit with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import typer

from traces.cli import trace_app

app = typer.Typer(
    help="kvflow: KV-cache tiering for LLM serving — simulate with real traces, or run on a GPU.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(trace_app, name="trace")


if __name__ == "__main__":
    app()
