"""Streaming loaders for Mooncake JSONL, Azure CSV and the generic kvflow JSONL.

Every loader reads one bounded line at a time (gzip when the name ends in
``.gz``), so a trace of any length costs memory for one request, and checks
each line cheaply (``traces.fields``): the 12k-request Mooncake conversation
trace streams in well under a second. A bad line raises
:class:`~traces.schema.TraceError` naming file, line and field, or with
``skip_bad`` is counted and skipped. :class:`~traces.schema.TraceLimits`
bounds a request's length and the bytes a pass reads.
"""

from __future__ import annotations

import csv
import errno
import gzip
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from traces import fields as F
from traces.fields import BOM, NS_PER_DAY, Bad, show
from traces.schema import (
    DEFAULT_BLOCK_TOKENS,
    FORMATS,
    MAX_BLOCK_TOKENS,
    Request,
    TraceError,
    TraceLimits,
)

#: At most this many skipped-line errors are kept on ``Trace.errors`` (the count is exact).
MAX_KEPT_ERRORS = 20

#: Version written in, and accepted from, the generic form's header line.
GENERIC_VERSION = 1

_MOONCAKE_KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})
_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")

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


def _open_binary(path: Path) -> BinaryIO:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _lines(path: Path, shown: str, limits: TraceLimits) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of each non-blank line.

    Reads at most ``limits.max_line_bytes`` for a line and
    ``limits.max_trace_bytes`` in all (after gzip), so no file, however
    built, makes a pass hold more than one bounded line; past either limit,
    and on gzip damage, a TraceError names the line.
    """
    lineno = 0
    total = 0
    most = limits.max_line_bytes
    budget = limits.max_trace_bytes
    try:
        with _open_binary(path) as f:
            readline = f.readline
            while raw := readline(most + 1):
                lineno += 1
                total += len(raw)
                if total > budget:
                    raise TraceError(
                        f"the trace goes on past {budget:,} bytes, the limit one pass reads "
                        "(max_trace_bytes: --max-trace-bytes or KVFLOW_MAX_TRACE_BYTES "
                        "raises it)", shown, lineno)
                if len(raw) > most and raw[-1:] != b"\n":
                    raise TraceError(
                        f"line longer than {most:,} bytes, the most a request at the "
                        f"limit of {limits.max_request_tokens:,} tokens can take "
                        "(max_request_tokens: --max-request-tokens raises it)", shown, lineno)
                if lineno == 1 and raw.startswith(BOM):
                    raw = raw[3:]
                if raw.isspace() or not raw:
                    continue
                yield lineno, raw
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise TraceError(
            f"cannot read compressed data: {exc or type(exc).__name__}", shown, lineno + 1
        ) from None


def _peek(path: Path, shown: str, limits: TraceLimits) -> tuple[int, bytes] | None:
    for item in _lines(path, shown, limits):
        return item
    return None


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
    limits: TraceLimits
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
        limits: TraceLimits | None = None,
    ) -> None:
        self.path = path
        self.format = fmt
        self.block_tokens = block_tokens
        self.skip_bad = skip_bad
        self.header = header
        self.limits = limits or TraceLimits()
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

    def _skip(self, bad: Bad, lineno: int) -> None:
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
        loads = F.parse_json
        for lineno, raw in _lines(self._file, self.path, self.limits):
            if lineno == self._header_line:
                continue
            try:
                obj = loads(raw)
                ts, n_in, n_out, ids, toks, session, tenant = parse(obj)
                if first is not None and ts < prev:
                    key = "timestamp" if "timestamp" in obj else "arrival_s"
                    raise Bad(
                        key, f"goes backwards: {show(obj[key])} is earlier than the line before"
                    )
            except Bad as bad:
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
            raise Bad(None, f"expected a JSON object, got {F.type_name(obj)}")
        ts = F.time_of(obj, "timestamp")
        n_in = F.count(obj, "input_length")
        n_out = F.count(obj, "output_length")
        F.check_tokens(n_in, n_out, self.limits)
        F.get(obj, "hash_ids")
        ids = F.hash_ids(obj)
        F.check_blocks(ids, n_in, self.block_tokens)
        return ts, n_in, n_out, ids, None, None, None

    # -- generic ----------------------------------------------------------

    def _parse_generic(self, obj: Any) -> _Record:
        if type(obj) is not dict:
            raise Bad(None, f"expected a JSON object, got {F.type_name(obj)}")
        if "kvflow_trace" in obj:
            raise Bad("kvflow_trace", "a header object may only be the first line")
        if "arrival_s" in obj:
            if "timestamp" in obj:
                raise Bad("arrival_s", "give one of 'timestamp' or 'arrival_s', not both")
            ts = F.time_of(obj, "arrival_s")
        elif "timestamp" in obj:
            ts = F.time_of(obj, "timestamp")
            if self._timestamp_ms:
                ts = ts / 1000
        else:
            raise Bad("timestamp", "required field is missing (give 'timestamp' or 'arrival_s')")
        toks = F.token_ids(obj) if obj.get("token_ids") is not None else None
        if "input_length" in obj:
            n_in = F.count(obj, "input_length")
            if toks is not None and len(toks) != n_in:
                raise Bad("input_length", f"is {n_in} but token_ids has {len(toks)} tokens")
        elif toks is not None:
            n_in = len(toks)
        else:
            raise Bad("input_length", "required field is missing (or give 'token_ids')")
        n_out = F.count(obj, "output_length")
        F.check_tokens(n_in, n_out, self.limits,
                       ("input_length" if "input_length" in obj else "token_ids",
                        "output_length"))
        ids = None
        if obj.get("hash_ids") is not None:
            ids = F.hash_ids(obj)
            F.check_blocks(ids, n_in, self.block_tokens)
        return ts, n_in, n_out, ids, toks, F.label(obj, "session_id"), F.label(obj, "tenant")

    # -- Azure ------------------------------------------------------------

    def _iter_azure(self) -> Iterator[Request]:
        assert self._columns is not None
        ncols, ti, ci, gi = self._columns
        days: F.Day = {}
        first: tuple[int, int] | None = None
        prev: tuple[int, int] = (0, 0)
        index = 0
        unique = -1
        bt = self.block_tokens
        top = self.limits.max_request_tokens
        for lineno, raw in _lines(self._file, self.path, self.limits):
            if lineno <= self._header_line:
                continue
            try:
                try:
                    text = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as exc:
                    raise Bad(None, f"not UTF-8 text: {exc.reason}") from None
                if text.startswith("\ufeff"):
                    raise Bad(None, "a byte-order mark (U+FEFF) starts this line; one may "
                                    "only start the file")
                cells = _csv_cells(text)
                if len(cells) != ncols:
                    raise Bad(None, f"expected {ncols} columns, got {len(cells)}")
                ts = F.wallclock(cells[ti].strip(), days)
                n_in = F.natural(cells[ci], "ContextTokens", top)
                n_out = F.natural(cells[gi], "GeneratedTokens", top)
                F.check_tokens(n_in, n_out, self.limits, ("ContextTokens", "GeneratedTokens"))
                if first is not None and ts < prev:
                    raise Bad(
                        "TIMESTAMP",
                        f"goes backwards: {cells[ti].strip()!r} is before an earlier line's",
                    )
            except Bad as bad:
                self._skip(bad, lineno)
                continue
            if first is None:
                first = ts
            prev = ts
            n = -(-n_in // bt)
            ids = tuple(range(unique, unique - n, -1))
            unique -= n
            arrival = ((ts[0] - first[0]) * NS_PER_DAY + ts[1] - first[1]) / 1e9
            yield Request(index, arrival, n_in, n_out, ids, None, None, None)
            index += 1


def _csv_cells(text: str) -> list[str]:
    """The cells of one CSV row; quoting as the csv module reads it, errors as Bad."""
    if '"' not in text and "\x00" not in text:
        return text.split(",")
    try:
        return next(csv.reader([text]))
    except csv.Error as exc:
        raise Bad(None, f"malformed CSV row: {exc}") from None


_SNIFF_LINES = 50


def _detect(file: Path, shown: str, first: bytes | None, limits: TraceLimits) -> str:
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
        for n, (_, raw) in enumerate(_lines(file, shown, limits)):
            if n >= _SNIFF_LINES:
                break
            try:
                obj = F.parse_json(raw)
            except Bad:
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
    limits: TraceLimits | None = None,
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

    ``limits`` bounds a request's tokens and the bytes a pass reads (default:
    :meth:`TraceLimits.from_env`, the environment's or the built-in limits).

    Raises ``FileNotFoundError`` / ``IsADirectoryError`` for a missing path and
    :class:`TraceError` for a file that is not a trace (bad header, unknown format).
    """
    if limits is None:
        limits = TraceLimits.from_env()
    shown = os.fspath(path)
    if not isinstance(shown, str):
        shown = os.fsdecode(shown)
    file = Path(shown)
    if fmt not in FORMATS:
        raise TraceError(
            f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}", shown, field="fmt"
        )
    if block_tokens is not None:
        _check_block_tokens(block_tokens, shown, None)
    if not file.exists():
        raise FileNotFoundError(errno.ENOENT, "no such trace file", shown)
    if file.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory, not a trace file", shown)

    peeked = _peek(file, shown, limits)
    first_line, first = peeked if peeked is not None else (0, None)
    if fmt == "auto":
        try:
            fmt = _detect(file, shown, first, limits)
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
        return Trace(shown, fmt, DEFAULT_BLOCK_TOKENS, skip_bad, limits=limits)

    if fmt == "azure":
        columns = _azure_columns(first, first_line, shown)
        return Trace(
            shown,
            fmt,
            block_tokens or DEFAULT_BLOCK_TOKENS,
            skip_bad,
            header_line=first_line,
            columns=columns,
            limits=limits,
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
        limits=limits,
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
    try:
        cells = _csv_cells(text)
    except Bad as bad:
        raise TraceError(bad.message, shown, line) from None
    names = [c.strip().strip('"').lower() for c in cells]
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
        obj = F.parse_json(first)
    except Bad:
        return None  # the iteration reports the malformed line (or skips it)
    if not isinstance(obj, dict) or "kvflow_trace" not in obj:
        return None
    version = obj["kvflow_trace"]
    if version != GENERIC_VERSION or type(version) is not int:
        raise TraceError(
            f"unsupported version {show(version)} (this reader knows {GENERIC_VERSION})",
            shown,
            line,
            "kvflow_trace",
        )
    bt = obj.get("block_tokens", DEFAULT_BLOCK_TOKENS)
    _check_block_tokens(bt, shown, line)
    unit = obj.get("time_unit", "s")
    if unit not in ("s", "ms"):
        raise TraceError(f'expected "s" or "ms", got {show(unit)}', shown, line, "time_unit")
    header = dict(obj)
    header["block_tokens"] = bt
    header["time_unit"] = unit
    return header


def _check_block_tokens(bt: Any, shown: str, line: int | None) -> None:
    if type(bt) is not int or bt <= 0:
        raise TraceError(f"expected a positive integer, got {show(bt)}", shown, line,
                         "block_tokens")
    if bt > MAX_BLOCK_TOKENS:
        raise TraceError(f"at most {MAX_BLOCK_TOKENS:,} tokens a block, got {bt:,}", shown, line,
                         "block_tokens")
