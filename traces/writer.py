"""Writer for the generic kvflow JSONL form (see ``traces/README.md``).

Writes to a temporary file beside the target and renames it into place, so a
failure half-way (a bad line in the source of a conversion, a full disk)
never leaves a truncated trace that would later load as a shorter one.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from traces.loaders import GENERIC_VERSION
from traces.schema import DEFAULT_BLOCK_TOKENS, Request


def header(block_tokens: int = DEFAULT_BLOCK_TOKENS, **extra: Any) -> dict[str, Any]:
    """The header object written on a generic trace's first line."""
    return {"kvflow_trace": GENERIC_VERSION, "block_tokens": block_tokens, **extra}


def record(req: Request, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> dict[str, Any]:
    """One request as a generic-form JSON object.

    Loader-assigned unique ids (negative: Azure, lengths-only records) are
    left out, so the file stays lengths-only and the reader assigns fresh
    unique ids again; real ids and tokens are written as they are.
    """
    rec: dict[str, Any] = {
        "arrival_s": req.arrival_s,
        "input_length": req.input_len,
        "output_length": req.output_len,
    }
    ids = req.block_hashes
    if ids is not None:
        if len(ids) != -(-req.input_len // block_tokens):
            raise ValueError(
                f"request {req.index}: {len(ids)} block hashes for input_len {req.input_len} "
                f"at block_tokens={block_tokens}"
            )
        if ids and min(ids) < 0:
            if max(ids) >= 0:
                raise ValueError(
                    f"request {req.index}: mixes negative (unique) and non-negative block ids"
                )
        else:
            rec["hash_ids"] = list(ids)
    if req.token_ids is not None:
        rec["token_ids"] = list(req.token_ids)
    if req.session_id is not None:
        rec["session_id"] = req.session_id
    if req.tenant is not None:
        rec["tenant"] = req.tenant
    return rec


def _open_text_out(path: Path, gz: bool) -> IO[str]:
    if gz:
        return gzip.open(path, "wt", encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def write_generic(
    requests: Iterable[Request],
    path: str | os.PathLike[str],
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    force: bool = False,
    **meta: Any,
) -> int:
    """Write ``requests`` as a generic JSONL trace (gzip if the name ends in ``.gz``).

    ``meta`` goes into the header (e.g. ``source=``, ``generator=``) for
    provenance; readers ignore keys they do not know. Refuses to replace an
    existing file unless ``force``. Returns the number of requests written.
    """
    target = Path(path)
    if target.exists() and not force:
        raise FileExistsError(f"{os.fspath(path)} exists (pass force=True to replace it)")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"no such directory: {target.parent}")
    if not replaceable(target):  # /dev/stdout, a FIFO: written in place, never renamed over
        count = 0
        with _open_text_out(target, gz=target.name.endswith(".gz")) as f:
            f.write(json.dumps(header(block_tokens, **meta)) + "\n")
            for req in requests:
                f.write(json.dumps(record(req, block_tokens)) + "\n")
                count += 1
        return count
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with _open_text_out(tmp, gz=target.name.endswith(".gz")) as f:
            f.write(json.dumps(header(block_tokens, **meta)) + "\n")
            for req in requests:
                f.write(json.dumps(record(req, block_tokens)) + "\n")
                count += 1
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return count


def replaceable(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` may be written by renaming a temporary file over it: it does not
    exist yet, or it is a regular file. Anything else (``/dev/null``, ``/dev/stdout``, a
    FIFO) is written in place: renaming over it would replace the device node (as root)
    with a regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return True
    return stat.S_ISREG(mode)
