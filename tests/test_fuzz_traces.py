"""Fuzzing every trace format through the CLI, in process (issue 20).

Hypothesis writes malformed and edge-case traces in every form kvflow reads
(Mooncake JSONL, Azure CSV, the generic JSONL with and without a header, each
plain or gzipped, the gzip sometimes damaged) and runs ``kvflow trace
validate``, ``kvflow trace stats`` and ``kvflow replay --mode cache`` on each.
Every run must end in exit 0, or exit 2 with one line on stderr naming the
file (and the line, where one is to blame); never a traceback (``AppCli``
re-raises anything but ``SystemExit``), never more memory than the file's
size warrants. And the three commands agree: whatever ``validate`` accepts,
the replay runs; whatever the replay refuses, ``validate`` refused first,
with the same line.

CI runs a few examples; ``KVFLOW_FUZZ_EXAMPLES=2000`` runs more, and
``KVFLOW_FUZZ_REPORT=path`` appends the outcome counts there as JSON.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
import tracemalloc
from collections import Counter
from pathlib import Path

from cli_helpers import AppCli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli import app

EXAMPLES = int(os.environ.get("KVFLOW_FUZZ_EXAMPLES", "10"))
#: The request limit the runs use: small enough that a request at it replays in a
#: blink at one token a block, so the edge cases at and over it stay cheap.
LIMIT = 4096
CLI = AppCli(app)
OUTCOMES: Counter[str] = Counter()

# -- values a hostile file puts where a number, a list or a label belongs ------------------
EDGE_INTS = [0, 1, 511, 512, 513, LIMIT - 1, LIMIT, LIMIT + 1, 2**31, 2**53 + 1, 2**63 - 1,
             2**63, 2**64, 10**12, -1, -(2**63)]
RAW_VALUES = ["-1", "1.5", "600.0", "1e308", "1e400", "-0.0", "NaN", "Infinity", "-Infinity",
              "true", "null", '"12"', "[]", "{}", '"\\ud800"', '"\\u0000"',
              "1" + "0" * 4400, "[" * 3000 + "]" * 3000, '"' + "x" * 5000 + '"']
BROKEN_LINES = [b"", b"   \t ", b"\xef\xbb\xbf{}", b"{", b"}", b"not json", b"\xff\xfe\x00",
                b"\x00" * 8, b"[1, 2, 3]", b'"a string"', b"null", b"{}",
                b'{"kvflow_trace": 1}', b"\xed\xa0\x80", b"," * 40, b'"a,"b",c']

small = st.integers(0, 3000)
edge = st.sampled_from(EDGE_INTS)


def raw(value: object) -> str:
    return json.dumps(value)


def bad(draw: st.DrawFn, rate: int) -> bool:
    """Whether to break something, ``rate`` times in 100."""
    return draw(st.integers(0, 99)) < rate


@st.composite
def json_value(draw: st.DrawFn, good: str, rate: int) -> str:
    """The JSON text of a field: ``good``, or ``rate`` times in 100 something else."""
    if not bad(draw, rate):
        return good
    return draw(st.one_of(
        edge.map(raw), st.sampled_from(RAW_VALUES),
        st.text(max_size=6).map(raw), st.lists(edge, max_size=3).map(raw),
    ))


def ids_for(n_in: int, bt: int, start: int) -> list[int]:
    return list(range(start, start + min(-(-n_in // bt), 64)))


@st.composite
def json_record(draw: st.DrawFn, fmt: str, bt: int, t: float, rate: int) -> bytes:
    """One request line of a JSONL format, its fields perhaps replaced, dropped or doubled."""
    n_in = draw(edge if bad(draw, rate) else small)
    n_out = draw(edge if bad(draw, rate) else small)
    fields: dict[str, str] = {}
    if fmt == "mooncake":
        fields["timestamp"] = raw(int(t * 1000))
        fields["input_length"] = raw(n_in)
        fields["output_length"] = raw(n_out)
        fields["hash_ids"] = raw(ids_for(n_in, 512, draw(st.integers(0, 40))))
    else:
        fields[draw(st.sampled_from(["arrival_s", "timestamp"]))] = raw(t)
        kind = draw(st.sampled_from(["lengths", "hash_ids", "token_ids"]))
        if kind == "token_ids":
            n = max(0, min(n_in, 600))
            toks = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
            if toks and bad(draw, rate):
                toks[draw(st.integers(0, n - 1))] = draw(edge)
            fields["token_ids"] = raw(toks)
        else:
            if kind == "hash_ids":
                n_in = min(n_in, 64 * bt)
                fields["hash_ids"] = raw(ids_for(n_in, bt, draw(st.integers(0, 40))))
            fields["input_length"] = raw(n_in)
        fields["output_length"] = raw(n_out)
        for label in ("session_id", "tenant"):
            if draw(st.booleans()):
                fields[label] = raw(draw(st.text(max_size=8)))
    for name in list(fields):
        fields[name] = draw(json_value(fields[name], rate))
    if fields and bad(draw, rate // 4):
        del fields[draw(st.sampled_from(sorted(fields)))]
    items = [f"{json.dumps(k)}: {v}" for k, v in fields.items()]
    if items and bad(draw, rate // 4):
        items.append(draw(st.sampled_from(items)))  # a key given twice
    if bad(draw, 10):
        items.append(f'"extra": {draw(json_value(raw(1), rate))}')
    return ("{" + ", ".join(items) + "}").encode("utf-8", "surrogatepass")


@st.composite
def azure_row(draw: st.DrawFn, t: float, rate: int) -> bytes:
    when = f"2023-11-16 {18 + int(t) // 3600 % 6:02d}:{int(t) // 60 % 60:02d}:{t % 60:09.6f}"
    cells = [when, str(draw(small)), str(draw(small))]
    if bad(draw, rate):
        cells[0] = draw(st.sampled_from([
            f"{t:.3f}", "2023-11-16 18:17:03.9799600Z", "2023-02-30 00:00:00",
            "2023-11-16 25:00:00", "1e300", "-5", "2023-11-16T18:17:03+05:30", "", "yesterday"]))
    if bad(draw, rate):
        cells[1] = draw(st.one_of(edge.map(str), st.sampled_from(RAW_VALUES[:8]),
                                  st.just("9" * 5000)))
    if bad(draw, rate):
        cells[2] = draw(st.one_of(edge.map(str), st.sampled_from([" 7 ", "0x10", "-3"])))
    if bad(draw, rate // 2):
        cells.append(draw(st.sampled_from(["extra", '"quoted, cell"', '"unclosed'])))
    if bad(draw, rate // 4):
        cells.pop()
    return ",".join(cells).encode()


@st.composite
def trace_file(draw: st.DrawFn) -> tuple[str, bytes, bool, bool, str]:
    """(suffix, content, gzip it, damage the gzip, format written)."""
    fmt = draw(st.sampled_from(["mooncake", "generic-header", "generic", "azure"]))
    bt = draw(st.sampled_from([1, 16, 512]))
    rate = draw(st.sampled_from([0, 0, 2, 10, 40]))  # percent of fields broken
    lines: list[bytes] = []
    if fmt == "generic-header":
        header = {"kvflow_trace": 1, "block_tokens": bt, "time_unit": "s"}
        text = "{" + ", ".join(f"{json.dumps(k)}: {draw(json_value(raw(v), rate))}"
                               for k, v in header.items()) + "}"
        lines.append(text.encode("utf-8", "surrogatepass"))
    elif fmt == "azure":
        lines.append(draw(st.sampled_from(
            [b"timestamp,contexttokens", b"\xef\xbb\xbf\xef\xbb\xbfTIMESTAMP,x",
             b"TIMESTAMP,TIMESTAMP,ContextTokens,GeneratedTokens"] if bad(draw, rate) else
            [b"TIMESTAMP,ContextTokens,GeneratedTokens",
             b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens"])))
    t = 0.0
    for _ in range(draw(st.integers(0, 12))):
        t += draw(st.sampled_from([0.0, 0.25, 1.0, -0.5, 1e7] if bad(draw, rate)
                                  else [0.0, 0.25, 1.0]))
        if bad(draw, rate // 2):
            lines.append(draw(st.sampled_from(BROKEN_LINES)))
        elif fmt == "azure":
            lines.append(draw(azure_row(max(t, 0.0), rate)))
        else:
            lines.append(draw(json_record("mooncake" if fmt == "mooncake" else "generic",
                                          bt if fmt == "generic-header" else 512,
                                          max(t, 0.0), rate)))
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    content = eol.join(lines) + draw(st.sampled_from([eol, b""]))
    zipped = draw(st.booleans())
    suffix = ".csv" if fmt == "azure" else ".jsonl"
    return suffix, content, zipped, zipped and draw(st.integers(0, 5)) == 0, fmt


def one_line_error(path: Path, code: int, out: str, err: str) -> str:
    """The ``error: FILE[:LINE]: ...`` line of a user error, checked."""
    assert code == 2, (code, out[-500:], err[-2000:])
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    line = lines[0]
    assert line.startswith(f"error: {path}"), line
    named = re.match(re.escape(f"error: {path}") + r"(:(\d+))?: ", line)
    assert named, line
    return line


@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 50,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(trace_file())
def test_every_run_ends_in_exit_0_or_one_line_naming_file_and_line(
        case: tuple[str, bytes, bool, bool, str]) -> None:
    suffix, content, zipped, damaged, fmt = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("trace" + suffix + (".gz" if zipped else ""))
        data = gzip.compress(content) if zipped else content
        if damaged:
            data = data[: max(10, len(data) // 2)]
        path.write_bytes(data)
        limit = ["--max-request-tokens", str(LIMIT)]
        runs = {
            "validate": ["trace", "validate", path, *limit],
            "stats": ["trace", "stats", path, "--json", *limit],
            "replay": ["replay", path, "--mode", "cache", "--json", *limit],
        }
        results = {}
        tracemalloc.start()
        try:
            for name, args in runs.items():
                tracemalloc.reset_peak()
                code, out, err = CLI.run(*args)
                peak = tracemalloc.get_traced_memory()[1]
                # what the file's size warrants: its requests at their limit, not a
                # claim in a line (a 60-byte line once became 2e9 block ids)
                assert peak < 48 * 2**20 + 300 * len(content), (name, peak, len(content))
                results[name] = (code, out, err)
        finally:
            tracemalloc.stop()
    kinds = []
    for code, out, err in results.values():
        if code == 0:
            kinds.append("ok")
            continue
        line = one_line_error(path, code, out, err)
        kinds.append("bad line" if re.match(re.escape(f"error: {path}") + r":\d+: ", line)
                     else "bad file")
    OUTCOMES.update(f"{n}: {k}" for n, k in zip(runs, kinds, strict=True))
    OUTCOMES["files"] += 1
    OUTCOMES[f"format {fmt}"] += 1
    OUTCOMES["gzip damaged" if damaged else ("gzip" if zipped else "plain")] += 1
    # the three agree: validate's verdict is the replay's and the stats'
    codes = {name: r[0] for name, r in results.items()}
    assert len(set(codes.values())) == 1, {n: (r[0], r[2][-300:]) for n, r in results.items()}
    if codes["validate"] == 2:
        errs = {r[2] for r in results.values()}
        assert len(errs) == 1, errs


def teardown_module() -> None:
    report = os.environ.get("KVFLOW_FUZZ_REPORT")
    if report and OUTCOMES:
        with open(report, "a") as f:
            f.write(json.dumps(dict(sorted(OUTCOMES.items()))) + "\n")
