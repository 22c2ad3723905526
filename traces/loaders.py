"""Streaming loaders for Mooncake JSONL, Azure CSV and the generic kvflow JSONL.

Every loader reads one line at a time (gzip when the name ends in ``.gz``), so
a trace of any length costs memory for one request, and checks each line
cheaply with plain ``type()`` tests instead of building a validation object
per line: the 12k-request Mooncake conversation trace streams in well under a
second. A bad line raises :class:`~traces.schema.TraceError` naming file, line
and field, or with ``skip_bad`` is counted and skipped.
"""

from __future__ import annotations

import csv
import errno
import gzip
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path
from typing import Any, BinaryIO

from traces.schema import DEFAULT_BLOCK_TOKENS, FORMATS, Request, TraceError

#: At most this many skipped-line errors are kept on ``Trace.errors`` (the count is exact).
MAX_KEPT_ERRORS = 20

#: Version written in, and accepted from, the generic form's header line.
GENERIC_VERSION = 1

_MOONCAKE_KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})
_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
_BOM = b"\xef\xbb\xbf"
_WALLCLOCK = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{1,2}):(\d{2}):(\d{2}(?:\.\d*)?)"
    r"(Z|[+-]\d{2}:?\d{2})?"
)

# A parsed record: (time in the trace's unit, input_len, output_len, hash ids,
# token ids, session, tenant). A tuple, not an object, to keep the hot loop lean.
_Record = tuple[
    "int | float",
    int,
    int,
    "tuple[int, ...] | None",
    "tuple[int, ...] | None",
    "str | None",
    "str | None",
]


class _Bad(Exception):
    """A line is wrong; the loop turns it into a TraceError with path and line."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _show(value: Any) -> str:
    """Render a bad value the way it appears in the file, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _get(obj: dict[str, Any], key: str) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise _Bad(key, "required field is missing") from None


def _count(obj: dict[str, Any], key: str) -> int:
    v = _get(obj, key)
    if type(v) is not int or v < 0:
        raise _Bad(key, f"expected a non-negative integer, got {_show(v)}")
    return v


def _time(obj: dict[str, Any], key: str) -> int | float:
    v = _get(obj, key)
    if (type(v) is not int and type(v) is not float) or not v >= 0 or v == math.inf:
        raise _Bad(key, f"expected a non-negative number, got {_show(v)}")
    return v


def _id_list(obj: dict[str, Any], key: str) -> tuple[int, ...]:
    v = obj[key]
    if type(v) is not list:
        raise _Bad(key, f"expected a list of non-negative integers, got {_show(v)}")
    if not all(type(h) is int for h in v) or (v and min(v) < 0):
        for i, h in enumerate(v):
            if type(h) is not int or h < 0:
                raise _Bad(key, f"expected non-negative integers, element {i} is {_show(h)}")
    return tuple(v)


def _check_blocks(ids: tuple[int, ...], input_len: int, block_tokens: int) -> None:
    want = -(-input_len // block_tokens)
    if len(ids) != want:
        raise _Bad(
            "hash_ids",
            f"{len(ids)} ids for input_length {input_len}; expected "
            f"ceil({input_len}/{block_tokens}) = {want}",
        )


def _opt_str(obj: dict[str, Any], key: str) -> str | None:
    v = obj.get(key)
    if v is None or type(v) is str:
        return v
    if type(v) is int:
        return str(v)
    raise _Bad(key, f"expected a string, got {_show(v)}")


def _json_msg(raw: bytes) -> str:
    """Why a line is not JSON, with a column that counts from the line's start."""
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        return f"malformed line: not UTF-8 text ({exc.reason} at byte {exc.start + 1})"
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return f"malformed JSON: {exc.msg} (column {exc.colno})"
    return "malformed JSON"


def _type_name(obj: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(obj), "null" if obj is None else type(obj).__name__
    )


def _open_binary(path: Path) -> BinaryIO:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _lines(path: Path, shown: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of each non-blank line; gzip damage -> TraceError."""
    lineno = 0
    try:
        with _open_binary(path) as f:
            for lineno, raw in enumerate(f, 1):
                if lineno == 1 and raw.startswith(_BOM):
                    raw = raw[3:]
                if len(raw) < 4 and not raw.strip():
                    continue
                yield lineno, raw
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise TraceError(
            f"cannot read compressed data: {exc or type(exc).__name__}", shown, lineno + 1
        ) from None


def _peek(path: Path, shown: str) -> tuple[int, bytes] | None:
    for item in _lines(path, shown):
        return item
    return None


_Day = dict[str, int]


_NS_PER_DAY = 86_400 * 10**9


def _wallclock(text: str, days: _Day) -> tuple[int, int]:
    """(day ordinal, nanoseconds in day) of an Azure timestamp, or (0, ns) for plain seconds.

    Integers all the way, so that subtracting the first request's time is
    exact: ``18:17:04.0319600 - 18:17:03.9799600`` is 0.052 s, not
    0.05199999999604188 as float seconds (or ~10 us off as seconds since year 1).
    """
    m = _WALLCLOCK.fullmatch(text)
    if m is None:
        try:
            secs = float(text)
        except ValueError:
            secs = math.nan
        if not secs >= 0 or secs == math.inf:
            raise _Bad(
                "TIMESTAMP",
                f"expected a timestamp like '2023-11-16 18:17:03.9799600' or seconds, got {text!r}",
            )
        return 0, round(secs * 1e9)
    day_s, hh, mm, ss, tz = m.groups()
    day = days.get(day_s)
    if day is None:
        try:
            day = date.fromisoformat(day_s).toordinal()
        except ValueError:
            raise _Bad("TIMESTAMP", f"invalid date in {text!r}") from None
        days[day_s] = day
    whole, _, frac = ss.partition(".")
    h, mi, s = int(hh), int(mm), int(whole)
    if h > 23 or mi > 59 or s > 60:
        raise _Bad("TIMESTAMP", f"invalid time of day in {text!r}")
    ns = (h * 3600 + mi * 60 + s) * 10**9 + int((frac + "000000000")[:9])
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        ns -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60) * 10**9
        if ns < 0:
            day, ns = day - 1, ns + _NS_PER_DAY
        elif ns >= _NS_PER_DAY:
            day, ns = day + 1, ns - _NS_PER_DAY
    return day, ns


def _natural(text: str, field: str) -> int:
    t = text.strip()
    if not (t.isascii() and t.isdigit()):
        raise _Bad(field, f"expected a non-negative integer, got {text!r}")
    return int(t)


class Trace:
    """A trace file opened for streaming; iterate it (again and again) for :class:`Request` s.

    Built by :func:`open_trace`, which has already sniffed the format and read
    any header, so ``format`` and ``block_tokens`` are known before the first
    request. After an iteration ``skipped`` is the number of bad lines passed
    over (``skip_bad=True``) and ``errors`` holds the first few of them.
    """

    path: str
    format: str
    block_tokens: int
    skip_bad: bool
    header: dict[str, Any] | None
    skipped: int
    errors: list[TraceError]

    def __init__(
        self,
        path: str,
        fmt: str,
        block_tokens: int,
        skip_bad: bool = False,
        header: dict[str, Any] | None = None,
        header_line: int = 0,
        timestamp_ms: bool = False,
        columns: tuple[int, int, int, int] | None = None,
    ) -> None:
        self.path = path
        self.format = fmt
        self.block_tokens = block_tokens
        self.skip_bad = skip_bad
        self.header = header
        self.skipped = 0
        self.errors = []
        self._file = Path(path)
        self._header_line = header_line
        self._timestamp_ms = timestamp_ms
        self._columns = columns

    def __repr__(self) -> str:
        return (
            f"Trace(path={self.path!r}, format={self.format!r}, "
            f"block_tokens={self.block_tokens}, skip_bad={self.skip_bad})"
        )

    def __iter__(self) -> Iterator[Request]:
        self.skipped = 0
        self.errors = []
        if self.format == "azure":
            return self._iter_azure()
        if self.format == "mooncake":
            return self._iter_jsonl(self._parse_mooncake, 1000)
        return self._iter_jsonl(self._parse_generic, 1)

    # -- shared -----------------------------------------------------------

    def _skip(self, bad: _Bad, lineno: int) -> None:
        err = TraceError(bad.message, self.path, lineno, bad.field)
        if not self.skip_bad:
            raise err
        self.skipped += 1
        if len(self.errors) < MAX_KEPT_ERRORS:
            self.errors.append(err)

    def _iter_jsonl(self, parse: Callable[[Any], _Record], per_second: int) -> Iterator[Request]:
        # Times stay in the file's unit until the subtraction, so Mooncake's
        # integer milliseconds give arrival_s == (ts - first) / 1000 exactly rounded.
        first: int | float | None = None
        prev: int | float = 0
        index = 0
        unique = -1  # next id for a block with no prefix information; counts down
        bt = self.block_tokens
        loads = json.loads
        for lineno, raw in _lines(self._file, self.path):
            if lineno == self._header_line:
                continue
            try:
                try:
                    obj = loads(raw)
                except ValueError:  # JSONDecodeError, UnicodeDecodeError
                    raise _Bad(None, _json_msg(raw)) from None
                ts, n_in, n_out, ids, toks, session, tenant = parse(obj)
                if first is not None and ts < prev:
                    key = "timestamp" if "timestamp" in obj else "arrival_s"
                    raise _Bad(
                        key, f"goes backwards: {_show(obj[key])} is earlier than the line before"
                    )
            except _Bad as bad:
                self._skip(bad, lineno)
                continue
            if first is None:
                first = ts
            prev = ts
            if ids is None and toks is None:
                n = -(-n_in // bt)
                ids = tuple(range(unique, unique - n, -1))
                unique -= n
            arrival = (ts - first) / per_second if per_second != 1 else float(ts - first)
            yield Request(index, arrival, n_in, n_out, ids, toks, session, tenant)
            index += 1

    # -- Mooncake ---------------------------------------------------------

    def _parse_mooncake(self, obj: Any) -> _Record:
        if type(obj) is not dict:
            raise _Bad(None, f"expected a JSON object, got {_type_name(obj)}")
        ts = _time(obj, "timestamp")
        n_in = _count(obj, "input_length")
        n_out = _count(obj, "output_length")
        _get(obj, "hash_ids")
        ids = _id_list(obj, "hash_ids")
        _check_blocks(ids, n_in, self.block_tokens)
        return ts, n_in, n_out, ids, None, None, None

    # -- generic ----------------------------------------------------------

    def _parse_generic(self, obj: Any) -> _Record:
        if type(obj) is not dict:
            raise _Bad(None, f"expected a JSON object, got {_type_name(obj)}")
        if "kvflow_trace" in obj:
            raise _Bad("kvflow_trace", "a header object may only be the first line")
        if "arrival_s" in obj:
            if "timestamp" in obj:
                raise _Bad("arrival_s", "give one of 'timestamp' or 'arrival_s', not both")
            ts = _time(obj, "arrival_s")
        elif "timestamp" in obj:
            ts = _time(obj, "timestamp")
            if self._timestamp_ms:
                ts = ts / 1000
        else:
            raise _Bad("timestamp", "required field is missing (give 'timestamp' or 'arrival_s')")
        toks = _id_list(obj, "token_ids") if obj.get("token_ids") is not None else None
        if "input_length" in obj:
            n_in = _count(obj, "input_length")
            if toks is not None and len(toks) != n_in:
                raise _Bad("input_length", f"is {n_in} but token_ids has {len(toks)} tokens")
        elif toks is not None:
            n_in = len(toks)
        else:
            raise _Bad("input_length", "required field is missing (or give 'token_ids')")
        n_out = _count(obj, "output_length")
        ids = None
        if obj.get("hash_ids") is not None:
            ids = _id_list(obj, "hash_ids")
            _check_blocks(ids, n_in, self.block_tokens)
        return ts, n_in, n_out, ids, toks, _opt_str(obj, "session_id"), _opt_str(obj, "tenant")

    # -- Azure ------------------------------------------------------------

    def _iter_azure(self) -> Iterator[Request]:
        assert self._columns is not None
        ncols, ti, ci, gi = self._columns
        days: _Day = {}
        first: tuple[int, int] | None = None
        prev: tuple[int, int] = (0, 0)
        index = 0
        unique = -1
        bt = self.block_tokens
        for lineno, raw in _lines(self._file, self.path):
            if lineno <= self._header_line:
                continue
            try:
                try:
                    text = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise _Bad(None, f"not UTF-8 text: {exc.reason}") from None
                cells = next(csv.reader([text])) if '"' in text else text.split(",")
                if len(cells) != ncols:
                    raise _Bad(None, f"expected {ncols} columns, got {len(cells)}")
                ts = _wallclock(cells[ti].strip(), days)
                n_in = _natural(cells[ci], "ContextTokens")
                n_out = _natural(cells[gi], "GeneratedTokens")
                if first is not None and ts < prev:
                    raise _Bad(
                        "TIMESTAMP",
                        f"goes backwards: {cells[ti].strip()!r} is before an earlier line's",
                    )
            except _Bad as bad:
                self._skip(bad, lineno)
                continue
            if first is None:
                first = ts
            prev = ts
            n = -(-n_in // bt)
            ids = tuple(range(unique, unique - n, -1))
            unique -= n
            arrival = ((ts[0] - first[0]) * _NS_PER_DAY + ts[1] - first[1]) / 1e9
            yield Request(index, arrival, n_in, n_out, ids, None, None, None)
            index += 1


_SNIFF_LINES = 50


def _detect(file: Path, shown: str, first: bytes | None) -> str:
    """Format of a file from its first non-blank line (see :func:`open_trace`).

    A JSONL file whose first line is broken is judged by the first line that
    parses, so that ``skip_bad`` on a Mooncake file with a damaged head does
    not silently read millisecond timestamps as seconds.
    """
    name = file.name
    stem = name[:-3] if name.endswith(".gz") else name
    if first is None:
        return "azure" if stem.endswith(".csv") else "generic"
    if first.lstrip().startswith(b"{"):
        for n, (_, raw) in enumerate(_lines(file, shown)):
            if n >= _SNIFF_LINES:
                break
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict):
                if n == 0 and "kvflow_trace" in obj:
                    return "generic"
                return "mooncake" if obj.keys() <= _MOONCAKE_KEYS else "generic"
        return "generic"
    if b"," in first:
        return "azure"
    raise TraceError("cannot detect the format (expected JSONL or an Azure CSV); pass fmt=")


def open_trace(
    path: str | os.PathLike[str],
    fmt: str = "auto",
    skip_bad: bool = False,
    block_tokens: int | None = None,
) -> Trace:
    """Open a trace for streaming; nothing but its first line (or header) is read yet.

    ``fmt`` is ``"auto"`` (sniffed from the first line: a ``kvflow_trace``
    header -> generic; an object with only Mooncake's keys -> mooncake; any
    other object -> generic; a comma-separated header -> azure), or one of
    ``"mooncake"``, ``"azure"``, ``"generic"``. A name ending in ``.gz`` is
    read through gzip.

    ``block_tokens`` is the block size for traces that leave it open (Azure,
    headerless generic; default 512). A trace whose ids fix the block size
    (Mooncake: 512; generic: its header) rejects a different value rather
    than return ids that mean something else.

    Raises ``FileNotFoundError`` / ``IsADirectoryError`` for a missing path and
    :class:`TraceError` for a file that is not a trace (bad header, unknown format).
    """
    shown = os.fspath(path)
    if not isinstance(shown, str):
        shown = os.fsdecode(shown)
    file = Path(shown)
    if fmt not in FORMATS:
        raise TraceError(
            f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}", shown, field="fmt"
        )
    if block_tokens is not None and (type(block_tokens) is not int or block_tokens <= 0):
        raise TraceError(
            f"expected a positive integer, got {block_tokens!r}", shown, field="block_tokens"
        )
    if not file.exists():
        raise FileNotFoundError(errno.ENOENT, "no such trace file", shown)
    if file.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a trace file", shown)

    peeked = _peek(file, shown)
    first_line, first = peeked if peeked is not None else (0, None)
    if fmt == "auto":
        try:
            fmt = _detect(file, shown, first)
        except TraceError as exc:
            raise TraceError(exc.message, shown, first_line or None) from None

    if fmt == "mooncake":
        if block_tokens not in (None, DEFAULT_BLOCK_TOKENS):
            raise TraceError(
                f"Mooncake hash ids are per {DEFAULT_BLOCK_TOKENS}-token block; "
                f"they cannot be re-cut to {block_tokens}",
                shown,
                field="block_tokens",
            )
        return Trace(shown, fmt, DEFAULT_BLOCK_TOKENS, skip_bad)

    if fmt == "azure":
        columns = _azure_columns(first, first_line, shown)
        return Trace(
            shown,
            fmt,
            block_tokens or DEFAULT_BLOCK_TOKENS,
            skip_bad,
            header_line=first_line,
            columns=columns,
        )

    # generic
    header = _generic_header(first, first_line, shown)
    bt = block_tokens or DEFAULT_BLOCK_TOKENS
    if header is not None:
        hbt = header["block_tokens"]
        if block_tokens is not None and block_tokens != hbt:
            raise TraceError(
                f"the header says block_tokens={hbt}, asked for {block_tokens}",
                shown,
                first_line,
                "block_tokens",
            )
        bt = hbt
    return Trace(
        shown,
        "generic",
        bt,
        skip_bad,
        header=header,
        header_line=first_line if header is not None else 0,
        timestamp_ms=header is not None and header["time_unit"] == "ms",
    )


def _azure_columns(first: bytes | None, line: int, shown: str) -> tuple[int, int, int, int]:
    if first is None:
        raise TraceError(
            "empty file: expected a header TIMESTAMP,ContextTokens,GeneratedTokens", shown
        )
    try:
        text = first.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise TraceError("header is not UTF-8 text", shown, line) from None
    names = [c.strip().strip('"').lower() for c in next(csv.reader([text]))]
    where = []
    canonical = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    for want, shown_name in zip(_AZURE_COLUMNS, canonical, strict=True):
        if want not in names:
            raise TraceError(
                f"missing column in header {text!r} (expected "
                "TIMESTAMP,ContextTokens,GeneratedTokens)",
                shown,
                line,
                shown_name,
            )
        where.append(names.index(want))
    return len(names), where[0], where[1], where[2]


def _generic_header(first: bytes | None, line: int, shown: str) -> dict[str, Any] | None:
    """The header object if the first line is one (validated), else None."""
    if first is None:
        return None
    try:
        obj = json.loads(first)
    except ValueError:
        return None  # the iteration reports the malformed line (or skips it)
    if not isinstance(obj, dict) or "kvflow_trace" not in obj:
        return None
    version = obj["kvflow_trace"]
    if version != GENERIC_VERSION or type(version) is not int:
        raise TraceError(
            f"unsupported version {_show(version)} (this reader knows {GENERIC_VERSION})",
            shown,
            line,
            "kvflow_trace",
        )
    bt = obj.get("block_tokens", DEFAULT_BLOCK_TOKENS)
    if type(bt) is not int or bt <= 0:
        raise TraceError(
            f"expected a positive integer, got {_show(bt)}", shown, line, "block_tokens"
        )
    unit = obj.get("time_unit", "s")
    if unit not in ("s", "ms"):
        raise TraceError(f'expected "s" or "ms", got {_show(unit)}', shown, line, "time_unit")
    header = dict(obj)
    header["block_tokens"] = bt
    header["time_unit"] = unit
    return header
