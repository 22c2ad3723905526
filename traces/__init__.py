"""Request traces for kvflow: one schema, streaming loaders, generators and statistics.

This package depends on nothing else of kvflow (numpy only for the generators
and statistics), so the replay driver, notebooks and other tools can read
traces without the cache machinery::

    from traces import open_trace
    tr = open_trace("conversation_trace.jsonl")      # Mooncake JSONL, Azure CSV, generic
    for req in tr:                                    # streams Request objects in file order
        ...
    tr.skipped                                        # bad lines passed over (skip_bad=True)

Generators live in :mod:`traces.generate` (arrival processes in
:mod:`traces.arrivals`), statistics in :mod:`traces.stats`, load changes
(rate scaling, bounds, re-timing, repetition) in :mod:`traces.reshape` and
the offered load in :mod:`traces.load`; they are not imported here, so that
reading a trace needs no numpy. The generic JSONL form is documented in
``traces/README.md``.
"""

from __future__ import annotations

from pathlib import Path

from traces.chain import BlockChainer
from traces.loaders import GENERIC_VERSION, Trace, open_trace
from traces.schema import DEFAULT_BLOCK_TOKENS, FORMATS, Request, TraceError
from traces.writer import write_generic

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "FORMATS",
    "GENERIC_VERSION",
    "BlockChainer",
    "Request",
    "Trace",
    "TraceError",
    "open_trace",
    "sample_path",
    "samples",
    "write_generic",
]

_SAMPLES = Path(__file__).resolve().with_name("samples")


def sample_path(name: str = "conversation_1k.jsonl") -> Path:
    """Installed path of a bundled sample trace (see ``traces/samples/README.md``).

    The samples ship as package data so that examples and tests run without
    the ``../shared/traces`` checkout.
    """
    path = _SAMPLES / name
    if not path.is_file():
        raise FileNotFoundError(
            f"no sample trace {name!r}; available: {', '.join(samples()) or 'none'}"
        )
    return path


def samples() -> list[str]:
    """Names of the bundled sample traces."""
    if not _SAMPLES.is_dir():
        return []
    return sorted(p.name for p in _SAMPLES.iterdir() if p.suffix in (".jsonl", ".csv", ".gz"))
