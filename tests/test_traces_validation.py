"""Every validation error path: the error names file, line and field; --skip-bad counts."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import pytest

from traces import TraceError, open_trace

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def moon(**changes: object) -> str:
    rec = dict(GOOD)
    for k, v in changes.items():
        if v is ...:
            del rec[k]
        else:
            rec[k] = v
    return json.dumps(rec)


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def error_of(path: Path, **kw: object) -> TraceError:
    with pytest.raises(TraceError) as info:
        list(open_trace(path, **kw))  # type: ignore[arg-type]
    return info.value


def test_example_message_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "conversation_trace.jsonl", [moon()] * 16 + [moon(input_length=-3)])
    err = error_of(Path("conversation_trace.jsonl"))
    assert str(err) == (
        "conversation_trace.jsonl:17: field 'input_length': expected a non-negative integer, got -3"
    )
    assert (err.path, err.line, err.field) == ("conversation_trace.jsonl", 17, "input_length")
    assert isinstance(err, ValueError)
    again = pickle.loads(pickle.dumps(err))
    assert (str(again), again.line, again.field) == (str(err), 17, "input_length")


MOONCAKE_BAD = [
    # bad line, field, words in the message
    ('{"timestamp": 0, "input_length": ', None, "malformed JSON"),
    ("[1, 2, 3]", None, "expected a JSON object, got array"),
    ('"text"', None, "got string"),
    (moon(timestamp=...), "timestamp", "missing"),
    (moon(input_length=...), "input_length", "missing"),
    (moon(output_length=...), "output_length", "missing"),
    (moon(hash_ids=...), "hash_ids", "missing"),
    (moon(timestamp=-1), "timestamp", "non-negative number, got -1"),
    (moon(timestamp="0"), "timestamp", 'got "0"'),
    (moon(timestamp=True), "timestamp", "got true"),
    (
        '{"timestamp": NaN, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
        "timestamp",
        "got NaN",
    ),
    (moon(input_length="600"), "input_length", 'got "600"'),
    (moon(input_length=600.0), "input_length", "got 600.0"),
    (moon(input_length=None), "input_length", "got null"),
    (moon(output_length=-5), "output_length", "got -5"),
    (moon(output_length=False), "output_length", "got false"),
    (moon(hash_ids="1,2"), "hash_ids", "expected a list"),
    (moon(hash_ids=[1, "2"]), "hash_ids", 'element 1 is "2"'),
    (moon(hash_ids=[1, -2]), "hash_ids", "element 1 is -2"),
    (moon(hash_ids=[1, 2.0]), "hash_ids", "element 1 is 2.0"),
    # an id names a block with its whole prefix: one request cannot hold it twice (the
    # cache's plan took such a request's two positions for one block and failed an
    # assertion deep in admission)
    (moon(hash_ids=[7, 7]), "hash_ids", "element 1 repeats element 0 (id 7)"),
    (moon(hash_ids=[1]), "hash_ids", "1 ids for input_length 600; expected ceil(600/512) = 2"),
    (moon(hash_ids=[1, 2, 3]), "hash_ids", "3 ids"),
    (moon(input_length=0), "hash_ids", "expected ceil(0/512) = 0"),
]


@pytest.mark.parametrize(("bad", "field", "words"), MOONCAKE_BAD)
def test_mooncake_errors(tmp_path: Path, bad: str, field: str | None, words: str) -> None:
    p = write(tmp_path / "t.jsonl", [moon(), moon(), bad, moon()])
    err = error_of(p, fmt="mooncake")
    assert (err.path, err.line, err.field) == (str(p), 3, field)
    assert words in str(err)
    assert str(err).startswith(f"{p}:3: ")
    # and --skip-bad passes over it
    tr = open_trace(p, fmt="mooncake", skip_bad=True)
    assert [r.index for r in tr] == [0, 1, 2]
    assert tr.skipped == 1 and tr.errors[0].line == 3


def test_invalid_utf8_is_a_bad_line(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(moon().encode() + b'\n{"timestamp": "\xff"}\n' + moon().encode() + b"\n")
    err = error_of(p)
    assert (err.line, err.field) == (2, None) and "malformed" in str(err)
    a = tmp_path / "a.csv"
    a.write_bytes(f"{HEADER}\n{ROW}\n".encode() + b"\xff,1,1\n")
    err = error_of(a)
    assert (err.line, err.field) == (3, None) and "UTF-8" in str(err)


def test_timestamp_going_backwards(tmp_path: Path) -> None:
    p = write(tmp_path / "t.jsonl", [moon(timestamp=5), moon(timestamp=7), moon(timestamp=6)])
    err = error_of(p)
    assert (err.line, err.field) == (3, "timestamp")
    assert "backwards" in str(err)
    tr = open_trace(p, skip_bad=True)
    assert [r.arrival_s for r in tr] == [0.0, 0.002] and tr.skipped == 1


def test_skip_bad_counts_and_rebases(tmp_path: Path) -> None:
    lines = [
        "not json",
        moon(timestamp=1000),
        "",
        moon(input_length=-1),
        moon(timestamp=900),
        moon(timestamp=3000),
        "{}",
    ]
    p = write(tmp_path / "t.jsonl", lines)
    assert error_of(p, fmt="mooncake").line == 1
    tr = open_trace(p, fmt="mooncake", skip_bad=True)
    reqs = list(tr)
    assert [r.arrival_s for r in reqs] == [0.0, 2.0]  # first good request is the origin
    assert [r.index for r in reqs] == [0, 1]
    assert tr.skipped == 4
    assert [e.line for e in tr.errors] == [1, 4, 5, 7]
    list(tr)
    assert tr.skipped == 4  # reset per iteration, not accumulated


GENERIC_BAD = [
    ('{"kvflow_trace": 1}', "kvflow_trace", "only be the first line"),
    (
        '{"arrival_s": 0, "timestamp": 0, "input_length": 1, "output_length": 1}',
        "arrival_s",
        "not both",
    ),
    ('{"input_length": 1, "output_length": 1}', "timestamp", "missing"),
    ('{"arrival_s": -1, "input_length": 1, "output_length": 1}', "arrival_s", "got -1"),
    ('{"arrival_s": 0, "output_length": 1}', "input_length", "missing"),
    (
        '{"arrival_s": 0, "input_length": 3, "output_length": 1, "token_ids": [1, 2]}',
        "input_length",
        "token_ids has 2 tokens",
    ),
    ('{"arrival_s": 0, "output_length": 1, "token_ids": [1, "a"]}', "token_ids", "element 1"),
    ('{"arrival_s": 0, "output_length": 1, "token_ids": 5}', "token_ids", "expected a list"),
    (
        '{"arrival_s": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
        "hash_ids",
        "ceil(5/4) = 2",
    ),
    (
        '{"arrival_s": 0, "input_length": 1, "output_length": 1, "session_id": [1]}',
        "session_id",
        "expected a string",
    ),
    (
        '{"arrival_s": 0, "input_length": 1, "output_length": 1, "tenant": 1.5}',
        "tenant",
        "expected a string",
    ),
    ('{"arrival_s": 0, "input_length": 1}', "output_length", "missing"),
]


@pytest.mark.parametrize(("bad", "field", "words"), GENERIC_BAD)
def test_generic_errors(tmp_path: Path, bad: str, field: str, words: str) -> None:
    good = '{"arrival_s": 0, "input_length": 1, "output_length": 1}'
    p = write(tmp_path / "g.jsonl", ['{"kvflow_trace": 1, "block_tokens": 4}', good, bad, good])
    err = error_of(p)
    assert (err.line, err.field) == (3, field)
    assert words in str(err)
    tr = open_trace(p, skip_bad=True)
    assert len(list(tr)) == 2 and tr.skipped == 1


@pytest.mark.parametrize(
    ("header", "field", "words"),
    [
        ('{"kvflow_trace": 2}', "kvflow_trace", "unsupported version 2"),
        ('{"kvflow_trace": "1"}', "kvflow_trace", "unsupported version"),
        ('{"kvflow_trace": 1, "block_tokens": 0}', "block_tokens", "positive integer, got 0"),
        ('{"kvflow_trace": 1, "block_tokens": "16"}', "block_tokens", "positive integer"),
        ('{"kvflow_trace": 1, "time_unit": "us"}', "time_unit", '"s" or "ms"'),
    ],
)
def test_generic_header_errors(tmp_path: Path, header: str, field: str, words: str) -> None:
    p = write(tmp_path / "g.jsonl", ["", header])
    with pytest.raises(TraceError) as info:
        open_trace(p, skip_bad=True)  # a bad header is fatal even with skip_bad
    assert (info.value.line, info.value.field) == (2, field)
    assert words in str(info.value)


def test_block_tokens_conflicts(tmp_path: Path) -> None:
    g = write(tmp_path / "g.jsonl", ['{"kvflow_trace": 1, "block_tokens": 16}'])
    assert open_trace(g, block_tokens=16).block_tokens == 16
    with pytest.raises(TraceError, match="header says block_tokens=16, asked for 32") as info:
        open_trace(g, block_tokens=32)
    assert info.value.field == "block_tokens"
    m = write(tmp_path / "m.jsonl", [moon()])
    assert open_trace(m, block_tokens=512).block_tokens == 512
    with pytest.raises(TraceError, match="cannot be re-cut to 16"):
        open_trace(m, block_tokens=16)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(TraceError, match="positive integer"):
            open_trace(m, block_tokens=bad)  # type: ignore[arg-type]


def test_open_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_trace(tmp_path / "missing.jsonl")
    with pytest.raises(IsADirectoryError):
        open_trace(tmp_path)
    m = write(tmp_path / "m.jsonl", [moon()])
    with pytest.raises(TraceError, match="unknown format 'parquet'"):
        open_trace(m, fmt="parquet")
    odd = write(tmp_path / "odd.txt", ["hello world"])
    with pytest.raises(TraceError, match="cannot detect the format") as info:
        open_trace(odd)
    assert info.value.line == 1
    garbage = tmp_path / "x.jsonl.gz"
    garbage.write_bytes(b"this is not gzip data at all")
    with pytest.raises(TraceError, match="compressed"):
        open_trace(garbage)
    truncated = tmp_path / "y.jsonl.gz"
    truncated.write_bytes(gzip.compress((moon() + "\n").encode() * 2000)[:-40])
    tr = open_trace(truncated, skip_bad=True)
    with pytest.raises(TraceError, match="compressed"):
        list(tr)  # damage is not a bad line: never skipped


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
ROW = "2023-11-16 18:17:03.9799600,4808,10"

AZURE_BAD = [
    ("2023-11-16 18:17:04.0,4808", None, "expected 3 columns, got 2"),
    ("2023-11-16 18:17:04.0,4808,10,1", None, "expected 3 columns, got 4"),
    ("yesterday,4808,10", "TIMESTAMP", "expected a timestamp like"),
    ("2023-13-45 18:17:04.0,4808,10", "TIMESTAMP", "invalid date"),
    ("2023-11-16 25:17:04.0,4808,10", "TIMESTAMP", "invalid time of day"),
    ("2023-11-16 18:17:04.0,-3,10", "ContextTokens", "non-negative integer, got '-3'"),
    ("2023-11-16 18:17:04.0,,10", "ContextTokens", "got ''"),
    ("2023-11-16 18:17:04.0,4808,1.5", "GeneratedTokens", "got '1.5'"),
    ("2023-11-16 18:17:03.0,4808,10", "TIMESTAMP", "backwards"),
]


@pytest.mark.parametrize(("bad", "field", "words"), AZURE_BAD)
def test_azure_errors(tmp_path: Path, bad: str, field: str | None, words: str) -> None:
    p = write(tmp_path / "a.csv", [HEADER, ROW, bad, ROW])
    err = error_of(p)
    assert (err.line, err.field) == (3, field)
    assert words in str(err)
    tr = open_trace(p, skip_bad=True)
    assert len(list(tr)) == 2 and tr.skipped == 1


def test_azure_header_errors(tmp_path: Path) -> None:
    p = write(tmp_path / "a.csv", ["TIMESTAMP,Context,GeneratedTokens", ROW])
    with pytest.raises(TraceError, match="missing column") as info:
        open_trace(p)
    assert (info.value.line, info.value.field) == (1, "ContextTokens")
    empty = tmp_path / "e.csv"
    empty.write_text("")
    with pytest.raises(TraceError, match="empty file"):
        open_trace(empty)
    with pytest.raises(TraceError, match="empty file"):
        open_trace(empty, fmt="azure")


def test_damaged_first_line_does_not_change_the_format(tmp_path: Path) -> None:
    # judged by the first line that parses: still Mooncake, still milliseconds
    p = write(
        tmp_path / "t.jsonl",
        ['{"timestamp": 0, "input_len', moon(timestamp=1000), moon(timestamp=3000)],
    )
    assert error_of(p).line == 1
    tr = open_trace(p, skip_bad=True)
    assert tr.format == "mooncake"
    assert [r.arrival_s for r in tr] == [0.0, 2.0] and tr.skipped == 1
