"""Outputs to something that is not a regular file (/dev/null, /dev/stdout, a FIFO) are
written in place, never replaced by renaming a temporary file over them (issue 20, 13)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from cli_helpers import AppCli

from kvflow.reports import page
from traces.schema import Request
from traces.writer import replaceable, write_generic


def _drain(fifo: Path, got: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())
    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def _fifo(tmp_path: Path) -> Path:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    return fifo


def test_replaceable() -> None:
    assert replaceable("/dev/null") is False
    assert replaceable(Path(__file__)) is True
    assert replaceable("/no/such/file/here") is True


def test_replay_out_to_a_fifo_writes_into_it(tmp_path: Path) -> None:
    from cli import app

    fifo, got = _fifo(tmp_path), []
    reader = _drain(fifo, got)
    code, _, err = AppCli(app, "replay").run("--limit", "20", "--mode", "cache",
                                             "--out", fifo, "--force")
    reader.join(30)
    assert code == 0, err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # still a FIFO, not a regular file
    assert b'"kvflow_report"' in got[0]


def test_writers_write_into_a_fifo(tmp_path: Path) -> None:
    fifo, got = _fifo(tmp_path), []
    reader = _drain(fifo, got)
    write_generic([Request(0, 0.0, 16, 4)], fifo, block_tokens=16, force=True)
    reader.join(30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and got[0].count(b"\n") == 2
    got.clear()
    reader = _drain(fifo, got)
    page.write_files({fifo: "<html></html>"}, force=True)
    reader.join(30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and got[0] == b"<html></html>"
