"""The one request schema every loader and generator produces, and the error they raise.

Kept free of any I/O so that the replay driver, the generators and user code
can build :class:`Request` objects without pulling in a loader.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

#: Block size of the Mooncake traces, and the default everywhere else.
DEFAULT_BLOCK_TOKENS = 512
#: Largest block size a trace may ask for: a block is one unit of KV on every tier,
#: and a bigger one does not fit a GPU's memory for any model kvflow knows.
MAX_BLOCK_TOKENS = 65_536
#: Longest ``session_id`` / ``tenant`` label, in UTF-8 bytes (a tenant is hashed into
#: its blocks' keys; a label is a name, not a payload).
MAX_LABEL_BYTES = 4096
#: Token ids are hashed as 64-bit signed integers; hash ids are 64-bit unsigned.
TOKEN_ID_LIMIT = 2**63
HASH_ID_LIMIT = 2**64

#: Format names accepted by :func:`traces.open_trace` (``"auto"`` sniffs).
FORMATS = ("auto", "mooncake", "azure", "generic")


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace.

    Frozen and slotted because a replay holds tens of thousands of them and
    shares them between the scheduler and the metrics; nothing may mutate one.

    ``block_hashes`` has one id per ``block_tokens`` block of the prompt
    (``ceil(input_len / block_tokens)`` of them, the last usually partial).
    Ids are prefix-chained: two requests share an id only if they share the
    whole prompt up to and including that block. Non-negative ids come from
    the trace (or a generator); negative ids are assigned by the loaders to
    blocks known to be unique (Azure, lengths-only generic records), so they
    can never collide with another request's ids. Ids are namespaced per trace.

    ``token_ids`` is set instead when a generic trace gives the prompt's
    tokens; ``block_hashes`` is then ``None`` and the consumer hashes them with
    its own block size and salts (tenant, LoRA, ...).
    """

    index: int
    """0-based position among the requests the trace yielded (not the file line)."""
    arrival_s: float
    """Seconds since the trace's first request (the first request arrives at 0)."""
    input_len: int
    output_len: int
    block_hashes: tuple[int, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    session_id: str | None = None
    tenant: str | None = None

    def num_blocks(self, block_tokens: int) -> int:
        """Blocks the prompt spans at ``block_tokens`` tokens a block (last one partial)."""
        return -(-self.input_len // block_tokens)


class TraceError(ValueError):
    """A trace file is wrong: the message names the file, the 1-based line and the field.

    ``str(err)`` reads ``conversation_trace.jsonl:17: field 'input_length':
    expected a non-negative integer, got -3`` so the CLI can print it as the
    single line a user needs. ``line`` is ``None`` for whole-file problems
    (unknown format, conflicting block size) and ``field`` is ``None`` when
    the line as a whole is bad (malformed JSON, wrong column count).
    """

    def __init__(
        self,
        message: str,
        path: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.path = path
        self.line = line
        self.field = field
        super().__init__(self._format())

    def _format(self) -> str:
        where = ""
        if self.path is not None:
            where = self.path if self.line is None else f"{self.path}:{self.line}"
            where += ": "
        elif self.line is not None:
            where = f"line {self.line}: "
        what = f"field '{self.field}': " if self.field is not None else ""
        return f"{where}{what}{self.message}"

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, str | None, int | None, str | None]]:
        # Exceptions cross process boundaries (dask, multiprocessing sweeps).
        return (type(self), (self.message, self.path, self.line, self.field))


#: The environment variable of each :class:`TraceLimits` field.
LIMIT_ENV = {"max_request_tokens": "KVFLOW_MAX_REQUEST_TOKENS",
             "max_trace_bytes": "KVFLOW_MAX_TRACE_BYTES"}


@dataclass(frozen=True)
class TraceLimits:
    """Bounds on what one trace may ask of the reader, so a hostile or broken file
    costs a clear error instead of all the memory there is.

    ``max_request_tokens`` bounds one request's prompt plus answer: a 60-byte
    lengths-only line claiming 10^12 tokens would otherwise become ~2 * 10^9
    block ids. ``max_trace_bytes`` bounds the bytes one pass reads (after
    gzip: a small compressed file can expand without end); it also bounds any
    single line. Defaults are far above any public trace; raise them through
    the CLI options or ``KVFLOW_MAX_REQUEST_TOKENS`` / ``KVFLOW_MAX_TRACE_BYTES``.
    """

    max_request_tokens: int = 2**21
    max_trace_bytes: int = 8 * 2**30

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if type(v) is not int or v <= 0:
                raise TraceError(f"expected a positive integer, got {v!r}", field=f.name)

    @property
    def max_line_bytes(self) -> int:
        """Longest line read: room for a request at the token limit written out as
        token ids and hash ids (under 48 bytes a token), plus 1 MiB of other keys."""
        return min(self.max_trace_bytes, 2**20 + 48 * self.max_request_tokens)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **given: int | None) -> TraceLimits:
        """Limits from ``given`` values, else the environment, else the defaults."""
        env = os.environ if env is None else env
        values: dict[str, int] = {}
        for name, var in LIMIT_ENV.items():
            v = given.get(name)
            if v is None and env.get(var, "").strip():
                text = env[var].strip().replace("_", "")
                if not text.isdigit():
                    raise TraceError(f"expected a positive integer, got {env[var]!r}", field=var)
                v = int(text)
            if v is not None:
                values[name] = v
        unknown = set(given) - set(LIMIT_ENV)
        if unknown:
            raise TypeError(f"unknown limits: {', '.join(sorted(unknown))}")
        return cls(**values)
