"""A cluster described in a TOML file (``kvflow replay --cluster cluster.toml``).

Top-level keys are ``ReplayConfig`` fields, spelt as the config spells them
(``instances``, ``router``, ``tp``, ``pool_gb``, ``nic_gb_per_s``, ...): the
command line's options, with ``_`` for ``-``. A list of instance groups makes
the cluster heterogeneous; each group says how many instances it has and what
is theirs, every key it leaves out taken from the top level::

    router = "prefix"
    pool_gb = 4096
    pool_gb_per_s = 400

    [[group]]
    count = 8
    profile = "h100"

    [[group]]
    count = 4
    profile = "h200"
    tp = 2
    host_gb = 512

With groups, ``instances`` is their total (giving it too is allowed only if it
agrees). A group's ``profile`` is a preset or a profile TOML file, looked for
from the working directory, then beside the cluster file. Unknown keys, values
of the wrong type or out of range, and files that cannot be read raise
``ConfigError`` naming the file and the key (and the group, by its place in
the file, counting from 1).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import Any

from kvflow.errors import ConfigError
from kvflow.profile import PROFILES, _toml_load, load_profile

__all__ = ["GROUP_KEYS", "InstanceGroup", "read_cluster_file"]

#: Keys the file may not set at its top level: the trace and the file itself.
_NOT_IN_FILE = ("trace", "cluster")


@dataclass(frozen=True)
class InstanceGroup:
    """``count`` instances alike; None: the top level's value."""

    count: int
    profile: str | None = None
    tp: int | None = None
    device_blocks: int | None = None
    host_blocks: int | None = None
    storage_blocks: int | None = None
    device_gb: float | None = None
    host_gb: float | None = None
    storage_gb: float | None = None
    nic_gb_per_s: float | None = None
    nic_latency_s: float | None = None


#: Keys of a ``[[group]]`` table.
GROUP_KEYS = tuple(f.name for f in dataclasses.fields(InstanceGroup))


def read_cluster_file(path: str | os.PathLike[str], fields: dict[str, Any]
                      ) -> tuple[dict[str, Any], tuple[InstanceGroup, ...]]:
    """The file's top-level settings and its groups, checked.

    ``fields``: the config's field names and type hints (``typing.get_type_hints``
    of ``ReplayConfig``), which say what the top level may hold.
    """
    path = os.fspath(path)
    data = _toml_load(path)
    raw_groups = data.pop("group", [])
    known = [k for k in fields if k not in _NOT_IN_FILE]
    settings: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{path}: unknown key {key!r} (known: group, {', '.join(known)})")
        settings[key] = _typed(path, key, value, fields[key])
    if not isinstance(raw_groups, list) or not all(isinstance(g, dict) for g in raw_groups):
        raise ConfigError(f"{path}: key 'group' must be a list of tables ([[group]])")
    hints = typing.get_type_hints(InstanceGroup)
    groups = []
    for i, table in enumerate(raw_groups, 1):
        where = f"{path}: group {i}"
        for key in table:
            if key not in GROUP_KEYS:
                raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(GROUP_KEYS)})")
        if "count" not in table:
            raise ConfigError(f"{where}: key 'count' is missing (how many instances)")
        values = {k: _typed(where, k, v, hints[k]) for k, v in table.items()}
        if "profile" in values:
            values["profile"] = _profile_path(path, values["profile"])
        groups.append(_checked_group(where, InstanceGroup(**values)))
    return settings, tuple(groups)


def _typed(where: str, key: str, value: Any, hint: Any) -> Any:
    """``value`` as field ``key`` of type ``hint`` takes it (ints become floats where a float
    is wanted), or a ``ConfigError`` naming ``where`` and ``key``."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) or \
        typing.get_origin(hint) is typing.Union else (hint,)
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(t, "__name__", str(t)) for t in allowed if t is not type(None))
    raise ConfigError(f"{where}: key {key!r} must be {names}, got {value!r}")


def _profile_path(path: str, profile: str) -> str:
    """A profile that is neither a preset nor a file from here, but a file beside the
    cluster file, is that one."""
    if profile in PROFILES or os.path.isabs(profile) or os.path.isfile(profile):
        return profile
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), profile)
    return beside if os.path.isfile(beside) else profile


def _checked_group(where: str, g: InstanceGroup) -> InstanceGroup:
    """What only a group has: its count, and a profile that loads. Its other values are
    the config's fields and are checked as the config checks them
    (``kvflow.replay.config.cluster_file_settings``)."""
    if g.count < 1:
        raise ConfigError(f"{where}: key 'count' must be >= 1, got {g.count}")
    if g.profile is not None:
        try:
            load_profile(g.profile)
        except ConfigError as exc:
            raise ConfigError(f"{where}: key 'profile': {exc}") from None
    return g
