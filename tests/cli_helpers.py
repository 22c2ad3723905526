"""Running a typer app in-process the way the CLI tests check it.

Shared by the report, sweep, trace and replay command tests
(``from cli_helpers import AppCli``); it holds no tests itself. One copy of
the two rules those tests rely on: an exception other than ``SystemExit``
is re-raised, so a bug fails the test with its own traceback instead of
passing for an exit code; and a user error is exit code 2 with exactly one
line on stderr, ``error: ...``, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import typer
from typer.testing import CliRunner

_RUNNER = CliRunner()


class AppCli:
    """Invokes ``app`` with ``prefix`` before each call's arguments.

    ``columns`` sets ``COLUMNS`` for the call, so that tables are laid out at a
    known width (numbers asserted on are not wrapped or cut); ``None`` leaves
    the environment alone.
    """

    def __init__(self, app: typer.Typer, *prefix: str, columns: int | None = None) -> None:
        self.app = app
        self.prefix = prefix
        self.env = None if columns is None else {"COLUMNS": str(columns)}

    def run(self, *args: str | Path) -> tuple[int, str, str]:
        """Exit code, stdout and stderr of one invocation."""
        res = _RUNNER.invoke(self.app, [*self.prefix, *map(str, args)], env=self.env)
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            raise res.exception
        return res.exit_code, res.stdout, res.stderr

    def user_error(self, *args: str | Path) -> str:
        """The one ``error: ...`` line of an invocation that must fail as a user error."""
        code, out, err = self.run(*args)
        assert code == 2, (code, out, err)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert "Traceback" not in err
        return lines[0]
