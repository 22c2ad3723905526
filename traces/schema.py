"""The one request schema every loader and generator produces, and the error they raise.

Kept free of any I/O so that the replay driver, the generators and user code
can build :class:`Request` objects without pulling in a loader.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Block size of the Mooncake traces, and the default everywhere else.
DEFAULT_BLOCK_TOKENS = 512

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
