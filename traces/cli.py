"""``kvflow trace ...`` commands (placeholder until the traces issue lands)."""

import typer

trace_app = typer.Typer(help="Inspect, generate and convert request traces.", no_args_is_help=True)
