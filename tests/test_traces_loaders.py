"""Loaders: the real public traces, the bundled samples, gzip, the generic form, round trips."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import Request, Trace, TraceError, open_trace, sample_path, samples, write_generic

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
needs_shared = pytest.mark.skipif(
    not (SHARED / "conversation_trace.jsonl").is_file(),
    reason=f"public traces not found at {SHARED} (the ../shared checkout is absent)",
)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_blocks(reqs: list[Request], bt: int) -> None:
    for r in reqs:
        assert r.block_hashes is not None
        assert len(r.block_hashes) == ceil_div(r.input_len, bt)


# -- the real traces in ../shared/traces --------------------------------------

MOONCAKE = [
    # file, requests, first (input, output, ids[:3]), last (arrival_s, input, output, first ids)
    (
        "conversation_trace.jsonl",
        12031,
        (6758, 500, (0, 1, 2)),
        (3536.999, 20774, 508, (0, 182750)),
    ),
    ("synthetic_trace.jsonl", 3993, (40160, 6, (0, 1, 2)), (1022.025, 18440, 83, (17915, 17916))),
]


@needs_shared
@pytest.mark.parametrize(("name", "count", "first", "last"), MOONCAKE)
def test_mooncake_real(name: str, count: int, first: tuple, last: tuple) -> None:
    tr = open_trace(SHARED / name)
    assert (tr.format, tr.block_tokens) == ("mooncake", 512)
    reqs = list(tr)
    assert len(reqs) == count and tr.skipped == 0
    assert [r.index for r in reqs] == list(range(count))
    r0, rn = reqs[0], reqs[-1]
    assert (r0.arrival_s, r0.input_len, r0.output_len) == (0.0, *first[:2])
    assert r0.block_hashes[:3] == first[2]
    assert (rn.arrival_s, rn.input_len, rn.output_len) == last[:3]
    assert rn.block_hashes[: len(last[3])] == last[3]
    check_blocks(reqs, 512)
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    # prefix chaining: an id names one block at one depth, always under the same parent
    parent: dict[int, int] = {}
    for r in reqs:
        prev = -1
        for h in r.block_hashes:
            assert parent.setdefault(h, prev) == prev
            prev = h


@needs_shared
def test_mooncake_raw_fields_match_file() -> None:
    path = SHARED / "conversation_trace.jsonl"
    with open(path) as f:
        raw = [json.loads(line) for line in f]
    for rec, req in zip(raw, open_trace(path), strict=True):
        assert req.arrival_s == rec["timestamp"] / 1000
        assert req.input_len == rec["input_length"]
        assert req.output_len == rec["output_length"]
        assert list(req.block_hashes) == rec["hash_ids"]


def test_mooncake_streams_one_line_at_a_time(tmp_path: Path) -> None:
    """What "streams" means, checked as behaviour rather than as a time (speed is
    benchmarks/bench_replay.py's business): the first request comes before a bad
    last line is read, and a pass holds one request, not the file."""
    path = tmp_path / "big.jsonl"
    line = json.dumps({"timestamp": 0, "input_length": 2048, "output_length": 1,
                       "hash_ids": [1, 2, 3, 4]})
    path.write_text((line + "\n") * 20_000 + "not json\n")  # ~2 MB, bad at the end
    it = iter(open_trace(path))
    assert next(it).input_len == 2048  # the bad last line has not been parsed yet
    tracemalloc.start()
    try:
        n = 1
        with pytest.raises(TraceError) as info:
            for _ in it:
                n += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 20_000 and info.value.line == 20_001
    assert peak < 256 * 1024, peak  # one line's worth, not the file's 2 MB


AZURE = [
    # file, requests, first (input, output), last (arrival_s, input, output)
    ("AzureLLMInferenceTrace_code.csv", 8819, (4808, 10), (3435.948056, 549, 173)),
    ("AzureLLMInferenceTrace_conv.csv", 19366, (374, 44), (3501.721937, 197, 183)),
]


@needs_shared
@pytest.mark.parametrize(("name", "count", "first", "last"), AZURE)
def test_azure_real(name: str, count: int, first: tuple, last: tuple) -> None:
    tr = open_trace(SHARED / name)
    assert (tr.format, tr.block_tokens) == ("azure", 512)
    reqs = list(tr)
    assert len(reqs) == count
    assert (reqs[0].arrival_s, reqs[0].input_len, reqs[0].output_len) == (0.0, *first)
    rn = reqs[-1]
    assert rn.arrival_s == pytest.approx(last[0], abs=1e-9)
    assert (rn.input_len, rn.output_len) == last[1:]
    check_blocks(reqs, 512)
    ids = [h for r in reqs for h in r.block_hashes]
    assert all(h < 0 for h in ids)
    assert len(set(ids)) == len(ids)  # no prefix information: every block unique
    assert ids == list(range(-1, -len(ids) - 1, -1))
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)


@needs_shared
def test_azure_block_tokens_argument() -> None:
    tr = open_trace(SHARED / "AzureLLMInferenceTrace_code.csv", block_tokens=16)
    r0 = next(iter(tr))
    assert tr.block_tokens == 16 and len(r0.block_hashes) == ceil_div(4808, 16)


@needs_shared
def test_azure_subsecond_arrivals_exact() -> None:
    reqs = iter(open_trace(SHARED / "AzureLLMInferenceTrace_code.csv"))
    next(reqs)
    # 18:17:04.0319600 - 18:17:03.9799600, computed in integer nanoseconds
    assert next(reqs).arrival_s == 0.052


# -- bundled samples ------------------------------------------------------------


def test_samples_listed_and_loadable() -> None:
    assert {"conversation_1k.jsonl", "azure_code_500.csv"} <= set(samples())
    conv = list(open_trace(sample_path()))
    assert len(conv) == 1000 and conv[0].block_hashes[:2] == (0, 1)
    check_blocks(conv, 512)
    az = list(open_trace(sample_path("azure_code_500.csv")))
    assert len(az) == 500 and az[0].input_len == 4808
    with pytest.raises(FileNotFoundError, match="available"):
        sample_path("nope.jsonl")


@needs_shared
@pytest.mark.parametrize(
    ("sample", "source", "lines"),
    [
        ("conversation_1k.jsonl", "conversation_trace.jsonl", 1000),
        ("azure_code_500.csv", "AzureLLMInferenceTrace_code.csv", 501),
    ],
)
def test_samples_are_byte_identical_slices(sample: str, source: str, lines: int) -> None:
    data = sample_path(sample).read_bytes()
    original = (SHARED / source).read_bytes()
    assert original.startswith(data)
    assert data.count(b"\n") == lines and data.endswith(b"\n")
    readme = (sample_path(sample).parent / "README.md").read_text()
    assert hashlib.sha256(data).hexdigest() in readme
    assert hashlib.sha256(original).hexdigest() in readme


# -- gzip, detection, the generic form -------------------------------------------


def test_gzip_by_suffix(tmp_path: Path) -> None:
    src = sample_path()
    gz = tmp_path / "conv.jsonl.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    assert list(open_trace(gz)) == list(open_trace(src))
    azgz = tmp_path / "az.csv.gz"
    azgz.write_bytes(gzip.compress(sample_path("azure_code_500.csv").read_bytes()))
    tr = open_trace(azgz)
    assert tr.format == "azure" and len(list(tr)) == 500


def write(path: Path, *lines: str | dict) -> Path:
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return path


def test_detection_is_by_content(tmp_path: Path) -> None:
    moon = write(
        tmp_path / "a.txt", {"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [7]}
    )
    assert open_trace(moon).format == "mooncake"
    gen = write(tmp_path / "b.log", {"arrival_s": 0, "input_length": 3, "output_length": 1})
    assert open_trace(gen).format == "generic"
    hdr = write(tmp_path / "c.jsonl", {"kvflow_trace": 1, "block_tokens": 4})
    assert (open_trace(hdr).format, open_trace(hdr).block_tokens) == ("generic", 4)
    csv = tmp_path / "d.dat"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5,1\n")
    assert open_trace(csv).format == "azure"
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    assert list(open_trace(empty)) == []


def test_generic_form(tmp_path: Path) -> None:
    p = write(
        tmp_path / "g.jsonl",
        {"kvflow_trace": 1, "block_tokens": 4, "source": "hand-made", "future_key": [1]},
        {
            "arrival_s": 1.5,
            "input_length": 5,
            "output_length": 2,
            "hash_ids": [10, 11],
            "session_id": "s1",
            "tenant": "acme",
            "extra": "ignored",
        },
        "",
        {"timestamp": 2.0, "token_ids": [1, 2, 3, 4, 5, 6], "output_length": 0, "session_id": 7},
        {"arrival_s": 2.0, "input_length": 9, "output_length": 1},
        {"arrival_s": 3, "input_length": 0, "output_length": 1},
    )
    tr = open_trace(p)
    assert tr.header["source"] == "hand-made"
    a, b, c, d = list(tr)
    assert a == Request(0, 0.0, 5, 2, (10, 11), None, "s1", "acme")
    assert b == Request(1, 0.5, 6, 0, None, (1, 2, 3, 4, 5, 6), "7", None)
    assert c.block_hashes == (-1, -2, -3)  # lengths only: unique ids, negative range
    assert d.block_hashes == () and d.arrival_s == 1.5
    assert isinstance(d.arrival_s, float)


def test_generic_timestamp_ms(tmp_path: Path) -> None:
    p = write(
        tmp_path / "g.jsonl",
        {"kvflow_trace": 1, "time_unit": "ms"},
        {"timestamp": 1000, "input_length": 1, "output_length": 1},
        {"timestamp": 3500, "input_length": 1, "output_length": 1},
    )
    assert [r.arrival_s for r in open_trace(p)] == [0.0, 2.5]


def test_blank_lines_crlf_bom(tmp_path: Path) -> None:
    rec = json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]})
    p = tmp_path / "m.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + rec.encode() + b"\r\n\r\n  \n" + rec.encode())
    assert len(list(open_trace(p))) == 2


def test_azure_variants(tmp_path: Path) -> None:
    p = tmp_path / "az.csv"
    p.write_text(
        "GeneratedTokens,TIMESTAMP,ContextTokens\r\n"
        '3,"2024-05-10 23:59:59.5+00:00",1024\r\n'
        "4,2024-05-11T00:00:01.25Z,1025\r\n"
        "5,2024-05-11 02:00:02-02:00,0\r\n"
    )
    reqs = list(open_trace(p))
    assert [r.arrival_s for r in reqs] == [0.0, 1.75, 4 * 3600 + 2.5]
    assert [r.input_len for r in reqs] == [1024, 1025, 0]
    assert [r.output_len for r in reqs] == [3, 4, 5]
    assert [len(r.block_hashes) for r in reqs] == [2, 3, 0]
    secs = tmp_path / "secs.csv"
    secs.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10.5,1,1\n12,1,1\n")
    assert [r.arrival_s for r in open_trace(secs)] == [0.0, 1.5]


def test_request_is_frozen_and_slotted() -> None:
    r = Request(0, 0.0, 1, 1, (0,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.input_len = 2  # type: ignore[misc]
    assert not hasattr(r, "__dict__")
    assert r.num_blocks(512) == 1 and Request(0, 0.0, 1025, 0).num_blocks(512) == 3


def test_reiteration_and_early_stop() -> None:
    tr = open_trace(sample_path())
    it = iter(tr)
    first = next(it)
    it.close()  # a consumer that stops early closes the file
    assert next(iter(tr)) == first
    assert sum(1 for _ in tr) == 1000
    assert isinstance(tr, Trace) and "mooncake" in repr(tr)


# -- writing the generic form ------------------------------------------------------


def test_roundtrip_mooncake_sample(tmp_path: Path) -> None:
    src = list(open_trace(sample_path()))
    out = tmp_path / "conv.jsonl.gz"
    assert write_generic(src, out, source="mooncake") == 1000
    tr = open_trace(out)
    assert tr.format == "generic" and tr.header["source"] == "mooncake"
    assert list(tr) == src
    with pytest.raises(FileExistsError):
        write_generic(src, out)
    write_generic(src[:3], out, force=True)
    assert len(list(open_trace(out))) == 3


def test_roundtrip_azure_keeps_lengths_only(tmp_path: Path) -> None:
    src = list(open_trace(sample_path("azure_code_500.csv"), block_tokens=64))
    out = tmp_path / "az.jsonl"
    write_generic(src, out, block_tokens=64)
    first = json.loads(out.read_text().splitlines()[1])
    assert "hash_ids" not in first
    back = open_trace(out)
    assert back.block_tokens == 64
    assert list(back) == src  # same unique ids again: same counter, same order


def test_writer_leaves_nothing_on_failure(tmp_path: Path) -> None:
    def boom():
        yield Request(0, 0.0, 1, 1, (0,))
        raise RuntimeError("source broke")

    out = tmp_path / "x.jsonl"
    with pytest.raises(RuntimeError):
        write_generic(boom(), out)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="block hashes"):
        write_generic([Request(0, 0.0, 1025, 1, (0,))], out)
    with pytest.raises(ValueError, match="mixes"):
        write_generic([Request(0, 0.0, 1025, 1, (0, -1, 2))], out)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        write_generic([], tmp_path / "missing" / "x.jsonl")


ids = st.integers(min_value=0, max_value=2**63 - 1)


@st.composite
def request_lists(draw: st.DrawFn) -> tuple[int, list[Request]]:
    bt = draw(st.sampled_from([1, 4, 16, 512]))
    n = draw(st.integers(0, 12))
    gaps = draw(st.lists(st.floats(0, 1e4, allow_subnormal=False), min_size=n, max_size=n))
    t, reqs = 0.0, []
    for i in range(n):
        t = t + gaps[i] if i else 0.0
        n_in = draw(st.integers(0, 40))
        kind = draw(st.sampled_from(["hashes", "tokens", "both"]))
        hashes = tuple(
            draw(st.lists(ids, min_size=ceil_div(n_in, bt), max_size=ceil_div(n_in, bt),
                          unique=True))  # (a request holds each id once)
        )
        tokens = tuple(draw(st.lists(st.integers(0, 2**31), min_size=n_in, max_size=n_in)))
        reqs.append(
            Request(
                i,
                t,
                n_in,
                draw(st.integers(0, 10**6)),
                hashes if kind != "tokens" else None,
                tokens if kind != "hashes" else None,
                draw(st.none() | st.text(max_size=5)),
                draw(st.none() | st.text(max_size=5)),
            )
        )
    return bt, reqs


@settings(max_examples=40, deadline=None)
@given(request_lists())
def test_generic_roundtrip_property(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[int, list[Request]]
) -> None:
    bt, reqs = case
    out = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_generic(reqs, out, block_tokens=bt)
    back = list(open_trace(out))
    # arrival is relative to the first request, which the generator put at 0
    assert back == reqs
