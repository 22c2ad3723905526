"""Checks of one line of a trace, field by field, for the loaders.

Each check raises :class:`Bad` naming the field; the loaders add file and
line. They use plain ``type()`` tests rather than a validation object per
line, because they run once per request of traces of millions of lines.

What a check accepts, every consumer must be able to use: the replay hashes
token ids as 64-bit integers and tenants into its block keys, so those bounds
are checked here, where a bad line can still be named, and not left to fail
deep inside a replay.
"""

from __future__ import annotations

import json
import math
import re
import sys
from datetime import date
from typing import Any

from traces.schema import HASH_ID_LIMIT, MAX_LABEL_BYTES, TOKEN_ID_LIMIT, TraceLimits

BOM = b"\xef\xbb\xbf"
NS_PER_DAY = 86_400 * 10**9
_WALLCLOCK = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{1,2}):(\d{2}):(\d{2}(?:\.\d*)?)"
    r"(Z|[+-]\d{2}:?\d{2})?"
)
#: Largest time a trace may give, in its own unit: beyond it, differences of
#: times are no longer finite floats.
_MAX_TIME = sys.float_info.max / 4
#: Largest Azure time in plain seconds (its nanoseconds must stay finite).
_MAX_AZURE_SECONDS = 1e15


class Bad(Exception):
    """A line is wrong; the loop turns it into a TraceError with path and line."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def show(value: Any) -> str:
    """Render a bad value the way it appears in the file, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's keys must be unique: a second value for one would be silently lost."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise Bad(k, "duplicate key in the object (which value is meant?)")
            seen.add(k)
    return d


# One decoder for every line: ``json.loads`` with a hook builds a new one per call,
# which cost more than decoding a short line. (``loads`` also refuses a leading BOM,
# which ``parse_json`` does itself, first.)
_DECODE = json.JSONDecoder(object_pairs_hook=_unique_keys).decode


def parse_json(raw: bytes) -> Any:
    """One JSONL line (strict UTF-8, unique keys); any failure is a :class:`Bad` line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Bad(None, f"malformed line: not UTF-8 text ({exc.reason} at byte "
                        f"{exc.start + 1})") from None
    if text.startswith("\ufeff"):
        raise Bad(None, "a byte-order mark (U+FEFF) starts this line; one may only "
                        "start the file")
    try:
        return _DECODE(text)
    except json.JSONDecodeError as exc:
        raise Bad(None, f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise Bad(None, "malformed JSON: nested too deeply") from None
    except ValueError:  # an integer of more digits than Python converts
        raise Bad(None, f"malformed JSON: a number of more than "
                        f"{sys.get_int_max_str_digits()} digits") from None


def type_name(obj: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(obj), "null" if obj is None else type(obj).__name__
    )


def get(obj: dict[str, Any], key: str) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise Bad(key, "required field is missing") from None


def count(obj: dict[str, Any], key: str) -> int:
    v = get(obj, key)
    if type(v) is not int or v < 0:
        raise Bad(key, f"expected a non-negative integer, got {show(v)}")
    return v


def check_tokens(n_in: int, n_out: int, limits: TraceLimits,
                 fields: tuple[str, str] = ("input_length", "output_length")) -> None:
    """A request's prompt plus answer must be within ``limits.max_request_tokens``."""
    top = limits.max_request_tokens
    if n_in + n_out > top:
        field, n = (fields[0], n_in) if n_in > top else (fields[1], n_in + n_out)
        what = "the prompt" if n == n_in else "prompt plus answer"
        raise Bad(field, f"{what} is {n:,} tokens, over the limit of {top:,} a request "
                         "(max_request_tokens: --max-request-tokens or "
                         "KVFLOW_MAX_REQUEST_TOKENS raises it)")


def time_of(obj: dict[str, Any], key: str) -> int | float:
    v = get(obj, key)
    if (type(v) is not int and type(v) is not float) or not 0 <= v <= _MAX_TIME:
        raise Bad(key, f"expected a non-negative number, got {show(v)}")
    return v


_INT_ONLY = {int}


def id_list(obj: dict[str, Any], key: str, limit: int) -> tuple[int, ...]:
    """A list of integers in ``[0, limit)``."""
    v = obj[key]
    if type(v) is not list:
        raise Bad(key, f"expected a list of non-negative integers, got {show(v)}")
    # (the set of the ids' types: C speed, where a generator over every id was a tenth
    # of reading a trace)
    if v and ({*map(type, v)} != _INT_ONLY or min(v) < 0 or max(v) >= limit):
        for i, h in enumerate(v):
            if type(h) is not int or h < 0:
                raise Bad(key, f"expected non-negative integers, element {i} is {show(h)}")
            if h >= limit:
                raise Bad(key, f"expected integers below 2^{limit.bit_length() - 1}, "
                               f"element {i} is {show(h)}")
    return tuple(v)


def token_ids(obj: dict[str, Any]) -> tuple[int, ...]:
    return id_list(obj, "token_ids", TOKEN_ID_LIMIT)


def hash_ids(obj: dict[str, Any]) -> tuple[int, ...]:
    """A request's block ids. Each names a block together with its whole prefix (as
    Mooncake's traces hash them), so one request cannot hold an id twice: the cache
    would take both positions for one block."""
    ids = id_list(obj, "hash_ids", HASH_ID_LIMIT)
    if len({*ids}) != len(ids):
        first: dict[int, int] = {}
        for i, h in enumerate(ids):
            if h in first:
                raise Bad("hash_ids", f"element {i} repeats element {first[h]} (id {h}): a "
                                      "block id names the block with its whole prefix, so a "
                                      "request holds each id once")
            first[h] = i
    return ids


def check_blocks(ids: tuple[int, ...], input_len: int, block_tokens: int) -> None:
    want = -(-input_len // block_tokens)
    if len(ids) != want:
        raise Bad(
            "hash_ids",
            f"{len(ids)} ids for input_length {input_len}; expected "
            f"ceil({input_len}/{block_tokens}) = {want}",
        )


def label(obj: dict[str, Any], key: str) -> str | None:
    """An optional name (session, tenant): text that encodes to UTF-8, of bounded size."""
    v = obj.get(key)
    if v is None:
        return None
    if type(v) is int:
        v = str(v)
    elif type(v) is not str:
        raise Bad(key, f"expected a string, got {show(v)}")
    if len(v) > MAX_LABEL_BYTES // 4:
        try:
            size = len(v.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise Bad(key, f"not valid Unicode text: a lone surrogate at character "
                           f"{exc.start + 1}") from None
        if size > MAX_LABEL_BYTES:
            raise Bad(key, f"{size:,} bytes long; at most {MAX_LABEL_BYTES:,} are allowed")
    elif not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise Bad(key, f"not valid Unicode text: a lone surrogate at character "
                           f"{exc.start + 1}") from None
    return v


# -- Azure CSV -------------------------------------------------------------------------

Day = dict[str, int]


def wallclock(text: str, days: Day) -> tuple[int, int]:
    """(day ordinal, nanoseconds in day) of an Azure timestamp, or (0, ns) for plain seconds.

    Integers all the way, so that subtracting the first request's time is
    exact: ``18:17:04.0319600 - 18:17:03.9799600`` is 0.052 s, not
    0.05199999999604188 as float seconds (or ~10 us off as seconds since year 1).
    """
    m = _WALLCLOCK.fullmatch(text)
    if m is None:
        try:
            secs = float(text) if len(text) < 64 else math.nan
        except ValueError:
            secs = math.nan
        if not 0 <= secs <= _MAX_AZURE_SECONDS:
            raise Bad(
                "TIMESTAMP",
                f"expected a timestamp like '2023-11-16 18:17:03.9799600' or seconds "
                f"(at most {_MAX_AZURE_SECONDS:.0e}), got {text[:40]!r}",
            )
        return 0, round(secs * 1e9)
    day_s, hh, mm, ss, tz = m.groups()
    day = days.get(day_s)
    if day is None:
        try:
            day = date.fromisoformat(day_s).toordinal()
        except ValueError:
            raise Bad("TIMESTAMP", f"invalid date in {text!r}") from None
        days[day_s] = day
    whole, _, frac = ss.partition(".")
    h, mi, s = int(hh), int(mm), int(whole)
    if h > 23 or mi > 59 or s > 60:
        raise Bad("TIMESTAMP", f"invalid time of day in {text!r}")
    ns = (h * 3600 + mi * 60 + s) * 10**9 + int((frac + "000000000")[:9])
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        oh, om = int(digits[:2]), int(digits[2:])
        if oh > 23 or om > 59:
            raise Bad("TIMESTAMP", f"invalid UTC offset in {text!r}")
        ns -= sign * (oh * 3600 + om * 60) * 10**9
        if ns < 0:
            day, ns = day - 1, ns + NS_PER_DAY
        elif ns >= NS_PER_DAY:
            day, ns = day + 1, ns - NS_PER_DAY
    return day, ns


def natural(text: str, field: str, limit: int) -> int:
    """A non-negative integer cell, at most ``limit`` (checked before converting it)."""
    t = text.strip()
    if not (t.isascii() and t.isdigit()):
        raise Bad(field, f"expected a non-negative integer, got {text[:40]!r}")
    t = t.lstrip("0") or "0"
    if len(t) > len(str(limit)) or int(t) > limit:
        raise Bad(field, f"{t[:24]}{'...' if len(t) > 24 else ''} tokens is over the limit "
                         f"of {limit:,} a request (max_request_tokens: --max-request-tokens "
                         "or KVFLOW_MAX_REQUEST_TOKENS raises it)")
    return int(t)
