"""Issue 20: trace lines a hostile or broken writer produces.

Each case once raised something other than a ``TraceError`` (a ``ValueError``
traceback, a ``MemoryError``, an ``OverflowError`` deep in a replay) or was
silently accepted. Now every one is a ``TraceError`` naming file, line and
field, and whatever the loader accepts a replay can use (tokens hashed as
64-bit integers, tenants hashed into keys).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvflow.errors import ConfigError
from kvflow.hashing import BlockHasher, ExtraKeys
from traces import TraceError, open_trace
from traces.schema import MAX_LABEL_BYTES, TraceLimits

HEADER = json.dumps({"kvflow_trace": 1, "block_tokens": 4})
GOOD = json.dumps({"arrival_s": 0, "input_length": 5, "output_length": 1})


def write(path: Path, *lines: str, raw: bytes = b"") -> Path:
    path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8", "surrogatepass")
                     + raw)
    return path


def error_of(path: Path, **kw: object) -> TraceError:
    with pytest.raises(TraceError) as info:
        list(open_trace(path, **kw))  # type: ignore[arg-type]
    return info.value


def where(err: TraceError) -> tuple[int | None, str | None]:
    return err.line, err.field


# -- item 1: a huge length is refused before it is turned into block ids ------------------
@pytest.mark.parametrize("line", [
    '{"arrival_s": 0, "input_length": 1000000000000, "output_length": 1}',
    '{"arrival_s": 0, "input_length": 18446744073709551616, "output_length": 1}',
], ids=["1e12", "2^64"])
def test_a_huge_lengths_only_request_is_refused_not_allocated(tmp_path: Path, line: str) -> None:
    err = error_of(write(tmp_path / "t.jsonl", HEADER, GOOD, line))
    assert where(err) == (3, "input_length")
    assert "max_request_tokens" in str(err)


def test_huge_lengths_in_mooncake_and_azure_are_refused(tmp_path: Path) -> None:
    moon = write(tmp_path / "m.jsonl", json.dumps(
        {"timestamp": 0, "input_length": 10**12, "output_length": 1, "hash_ids": [1]}))
    assert where(error_of(moon)) == (1, "input_length")
    az = write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens",
               "0,10,1", "1,1000000000000,1", "2,10," + "9" * 5000)
    assert where(error_of(az)) == (3, "ContextTokens")
    assert where(error_of(az, skip_bad=False, block_tokens=16)) == (3, "ContextTokens")
    tr = open_trace(az, skip_bad=True)
    assert len(list(tr)) == 1 and [e.field for e in tr.errors] == [
        "ContextTokens", "GeneratedTokens"]


def test_the_request_limit_counts_prompt_and_answer_and_can_be_set(tmp_path: Path) -> None:
    p = write(tmp_path / "t.jsonl", HEADER,
              json.dumps({"arrival_s": 0, "input_length": 60, "output_length": 40}),
              json.dumps({"arrival_s": 1, "input_length": 60, "output_length": 41}))
    limits = TraceLimits(max_request_tokens=100)
    err = error_of(p, limits=limits)
    assert where(err) == (3, "output_length") and "101 tokens" in str(err)
    assert len(list(open_trace(p, limits=TraceLimits(max_request_tokens=101)))) == 2
    # the environment sets it where no value is given; a value given wins
    assert TraceLimits.from_env({"KVFLOW_MAX_REQUEST_TOKENS": "100"}) == limits
    assert TraceLimits.from_env({"KVFLOW_MAX_REQUEST_TOKENS": "100"},
                                max_request_tokens=7).max_request_tokens == 7
    with pytest.raises(TraceError, match=r"KVFLOW_MAX_TRACE_BYTES.*positive integer"):
        TraceLimits.from_env({"KVFLOW_MAX_TRACE_BYTES": "lots"})
    with pytest.raises(TraceError, match="max_request_tokens"):
        TraceLimits(max_request_tokens=0)


# -- the bytes a pass reads are bounded, gzip included ------------------------------------
def test_a_trace_past_the_byte_limit_stops_at_the_line_that_crosses_it(tmp_path: Path) -> None:
    p = write(tmp_path / "t.jsonl", HEADER, *[GOOD] * 10)
    size = len(HEADER) + 1 + len(GOOD) + 1
    err = error_of(p, limits=TraceLimits(max_trace_bytes=size + 10))
    assert err.line == 3 and "max_trace_bytes" in str(err)
    assert len(list(open_trace(p, limits=TraceLimits(max_trace_bytes=p.stat().st_size)))) == 10


def test_a_gzip_bomb_is_read_no_further_than_the_limit(tmp_path: Path) -> None:
    # 64 MiB of spaces on one line compress to ~64 KiB; reading it whole would hold it all.
    p = tmp_path / "bomb.jsonl.gz"
    with gzip.open(p, "wb", compresslevel=9) as f:
        f.write((HEADER + "\n" + GOOD + "\n").encode())
        chunk = b" " * 2**20
        for _ in range(64):
            f.write(chunk)
    assert p.stat().st_size < 2**20
    err = error_of(p, limits=TraceLimits(max_request_tokens=1000, max_trace_bytes=2**19))
    assert err.line == 3 and "max_trace_bytes" in str(err)
    # with room for the bytes but not for such a line: the line is refused, unread
    err = error_of(p, limits=TraceLimits(max_request_tokens=1000, max_trace_bytes=2**27))
    assert err.line == 3 and "line longer than" in str(err)


# -- item 3: JSON that Python's parser refuses with something else than JSONDecodeError ---
@pytest.mark.parametrize(("line", "words"), [
    ('{"arrival_s": 0, "input_length": 1' + "0" * 5000 + ', "output_length": 1}',
     "more than 4300 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
], ids=["5000-digits", "deep"])
def test_json_the_parser_chokes_on_is_a_bad_line(tmp_path: Path, line: str, words: str) -> None:
    err = error_of(write(tmp_path / "t.jsonl", HEADER, GOOD, line))
    assert where(err) == (3, None) and words in str(err)
    tr = open_trace(tmp_path / "t.jsonl", skip_bad=True)
    assert len(list(tr)) == 1 and tr.skipped == 1


# -- item 4: what a replay cannot hash is refused here, naming the field ------------------
@pytest.mark.parametrize(("record", "field", "words"), [
    ({"token_ids": [1, 2**63]}, "token_ids", "below 2^63, element 1"),
    ({"input_length": 5, "hash_ids": [1, 2**64]}, "hash_ids", "below 2^64, element 1"),
    ({"input_length": 1, "tenant": "t" * (MAX_LABEL_BYTES + 1)}, "tenant", "at most 4,096"),
    ({"input_length": 1, "tenant": "é" * 65_531}, "tenant", "131,062 bytes"),
    ({"input_length": 1, "tenant": "a\ud800b"}, "tenant", "lone surrogate at character 2"),
    ({"input_length": 1, "session_id": "\udfff"}, "session_id", "lone surrogate"),
    ({"arrival_s": 10**400, "input_length": 1}, "arrival_s", "non-negative number"),
], ids=["token-2^63", "hash-2^64", "tenant-4097", "tenant-131k", "tenant-surrogate",
        "session-surrogate", "arrival-10^400"])
def test_values_a_replay_cannot_use_are_refused(tmp_path: Path, record: dict, field: str,
                                               words: str) -> None:
    rec = {"arrival_s": 1, "output_length": 1, **record}
    p = tmp_path / "t.jsonl"
    p.write_text(HEADER + "\n" + GOOD + "\n" + json.dumps(rec) + "\n")  # ascii: \\ud800 escapes
    err = error_of(p)
    assert where(err) == (3, field) and words in str(err), str(err)


def test_values_at_the_edges_are_accepted_and_hash(tmp_path: Path) -> None:
    tenant = "租户" * (MAX_LABEL_BYTES // 6)  # 4,092 bytes of 3-byte characters
    p = write(tmp_path / "t.jsonl", HEADER, json.dumps(
        {"arrival_s": 0, "token_ids": [0, 2**63 - 1, 5, 6, 7], "output_length": 1,
         "tenant": tenant, "session_id": "😀"}))
    (req,) = open_trace(p)
    hashes = BlockHasher(4).hash_blocks(req.token_ids, extra=ExtraKeys(tenant_salt=req.tenant))
    assert len(hashes) == 1


@pytest.mark.parametrize(("call", "words"), [
    (lambda h: h.hash_blocks([1, 2**63, 3, 4]), "64-bit"),
    (lambda h: h.hash_blocks([1, 2, 3, 4], extra=ExtraKeys(tenant_salt="x" * 65_531)),
     "at most 65,530"),
    (lambda h: h.hash_blocks([1, 2, 3, 4], extra=ExtraKeys(tenant_salt="\ud800")),
     "not valid Unicode"),
], ids=["token-2^63", "salt-65531", "salt-surrogate"])
def test_the_hasher_refuses_what_it_cannot_hash_with_a_config_error(call, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        call(BlockHasher(4))


def test_block_sizes_no_model_fits_are_refused(tmp_path: Path) -> None:
    p = write(tmp_path / "t.jsonl", json.dumps({"kvflow_trace": 1, "block_tokens": 2**20}), GOOD)
    assert where(error_of(p)) == (1, "block_tokens")
    with pytest.raises(TraceError, match="65,536"):
        open_trace(write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens"),
                   block_tokens=65_537)


# -- item 6: whitespace-only lines are blank lines ----------------------------------------
def test_whitespace_only_lines_are_ignored(tmp_path: Path) -> None:
    p = write(tmp_path / "t.jsonl", HEADER, GOOD, "        ", "\t \t \t", " \r", GOOD)
    assert len(list(open_trace(p))) == 2
    a = write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens", "0,1,1",
              "            ", "1,2,2")
    assert len(list(open_trace(a))) == 2


# -- item 8: duplicate keys and a BOM after the first line are errors ---------------------
def test_a_duplicate_key_is_an_error_naming_it(tmp_path: Path) -> None:
    p = write(tmp_path / "t.jsonl", HEADER, GOOD,
              '{"arrival_s": 1, "input_length": 5, "output_length": 1, "input_length": 9}')
    err = error_of(p)
    assert where(err) == (3, "input_length") and "duplicate key" in str(err)
    nested = write(tmp_path / "n.jsonl", HEADER,
                   '{"arrival_s": 1, "input_length": 5, "output_length": 1, '
                   '"meta": {"a": 1, "a": 2}}')
    assert where(error_of(nested)) == (2, "a")
    dup_header = write(tmp_path / "h.jsonl", '{"kvflow_trace": 1, "kvflow_trace": 1}', GOOD)
    assert where(error_of(dup_header)) == (1, "kvflow_trace")


def test_a_byte_order_mark_after_the_first_line_is_an_error(tmp_path: Path) -> None:
    bom = "\ufeff"
    p = write(tmp_path / "t.jsonl", bom + HEADER, GOOD, bom + GOOD)
    err = error_of(p)
    assert where(err) == (3, None) and "byte-order mark" in str(err)
    a = write(tmp_path / "a.csv", bom + "TIMESTAMP,ContextTokens,GeneratedTokens", "0,1,1",
              bom + "1,2,2")
    assert where(error_of(a)) == (3, None)


# -- CSV cells Python's csv module or int() refuse ---------------------------------------
@pytest.mark.parametrize(("row", "field"), [
    ('0,"' + "x" * 200_000 + '",1', None),      # a quoted field past csv's size limit
    ('0,"1\x00",1', "ContextTokens"),             # NUL byte
    ("1e300,1,1", "TIMESTAMP"),                  # seconds whose nanoseconds overflow
    ("2023-11-16 18:17:03+99:99,1,1", "TIMESTAMP"),
], ids=["huge-field", "nul", "1e300", "offset"])
def test_csv_rows_the_parsers_refuse_are_bad_lines(tmp_path: Path, row: str,
                                                   field: str | None) -> None:
    p = write(tmp_path / "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens", "0,1,1", row)
    assert where(error_of(p)) == (3, field)


# -- the CLI: `trace validate`, and the limits as options ---------------------------------
def test_validate_accepts_a_good_trace_and_names_the_first_bad_line(tmp_path: Path) -> None:
    from cli_helpers import AppCli

    from cli import app

    cli = AppCli(app)
    code, out, _ = cli.run("trace", "validate", "sample:conversation_1k.jsonl")
    assert code == 0 and "valid mooncake trace, 1,000 requests" in out
    code, out, _ = cli.run("trace", "validate", "sample:azure_code_500.csv", "--json")
    assert code == 0 and json.loads(out)["requests"] == 500
    p = write(tmp_path / "t.jsonl", HEADER, GOOD, GOOD.replace('"input_length": 5',
                                                               '"input_length": 50'))
    line = cli.user_error("trace", "validate", p, "--max-request-tokens", "50")
    assert line.startswith(f"error: {p}:3: field 'output_length': prompt plus answer is 51")
    env_limited = AppCli(app)
    env_limited.env = {"KVFLOW_MAX_REQUEST_TOKENS": "50"}
    assert "field 'output_length'" in env_limited.user_error("trace", "stats", p)
    assert "field 'input_length'" in cli.user_error("trace", "convert", p, "-o",
                                                    tmp_path / "o.jsonl",
                                                    "--max-request-tokens", "10")
    assert not (tmp_path / "o.jsonl").exists()
    line = cli.user_error("replay", p, "--mode", "cache", "--max-trace-bytes", "40")
    assert f"{p}:2:" in line and "max_trace_bytes" in line
    assert cli.run("replay", p, "--mode", "cache", "--max-request-tokens", "51")[0] == 0
