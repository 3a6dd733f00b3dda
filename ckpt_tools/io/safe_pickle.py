"""Unpickling with an allow-list, after a bounds scan that builds nothing.

A pickle from a stranger runs code the moment a plain `pickle.loads` meets a global it names.
`load_allowed` resolves only the exact `(module, name)` pairs its caller allows (each mapped to what
the unpickler builds in its place: `formats.dcp.metadata` maps DCP's metadata classes to torch-free
stand-ins); anything else raises UnsafePickleError naming the global, before anything runs. Before
any unpickler runs, `check_pickle_bounds` (`io.pickle_scan`) replays the opcodes on a model stack and refuses
a pickle
whose object would cost more to build, hash or walk than its size allows.
"""

from __future__ import annotations

import enum
import io
import logging
import pickle
from collections.abc import Mapping

from ..core.errors import UnsafePickleError
from .pickle_scan import (
    MAX_INT_BITS,
    MAX_PICKLE_DEPTH,
    MIN_TREE_NODES,
    TREE_NODES_PER_BYTE,
    check_pickle_bounds,
    gc_paused,
)

__all__ = [
    "MAX_INT_BITS",
    "MAX_PICKLE_DEPTH",
    "MIN_TREE_NODES",
    "TREE_NODES_PER_BYTE",
    "AllowListUnpickler",
    "check_pickle_bounds",
    "load_allowed",
]

log = logging.getLogger(__name__)


class AllowListUnpickler(pickle.Unpickler):
    """Resolves a global only through `allowed` ({(module, name): object}); `trust` resolves any other
    one as plain pickle would (`--trust-remote-pickle`, logged). `what` names the file kind in errors
    ("a DCP .metadata file"), `short` in the persistent-id one ("DCP metadata")."""

    def __init__(
        self,
        fh,
        source: str,
        allowed: Mapping[tuple[str, str], object],
        *,
        trust: bool,
        what: str,
        short: str | None = None,
    ):
        super().__init__(fh)
        self._source = source
        self._allowed = allowed
        self._trust = trust
        self._what = what
        self._short = short or what

    def find_class(self, module: str, name: str):
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        if (module, name) == ("builtins", "getattr") and not self._trust:
            return self._enum_member

        if self._trust:
            log.warning(
                "--trust-remote-pickle: resolving %s.%s from %s outside the allow-list",
                module,
                name,
                self._source,
            )
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"refusing to unpickle global {module}.{name}: it is not a class {self._what} is made of, "
            "and unpickling it could run code",
            path=self._source,
            hint="if you wrote this checkpoint yourself and trust it, pass --trust-remote-pickle",
        )

    def _enum_member(self, cls, name):
        """`builtins.getattr` in the one form CPython 3.11.0-3.11.4 pickles an Enum member:
        `getattr(<enum class>, <member name>)` (enum `__reduce_ex__`; Debian's 3.11.2 wrote DCP's
        `_MEM_FORMAT_ENCODING` members so). Only an Enum class of this allow-list and one of its member
        names; any other getattr is refused, since it reaches any attribute of anything."""
        allowed_enum = (
            isinstance(cls, type)
            and issubclass(cls, enum.Enum)
            and any(cls is v for v in self._allowed.values())
        )
        if allowed_enum and type(name) is str and name in cls.__members__:
            return cls.__members__[name]
        raise UnsafePickleError(
            f"refusing to unpickle builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, "
            f"{name!r}): "
            f"only getattr(<allow-listed Enum class>, <member name>) is accepted in {self._what}, and "
            "anything else could reach any attribute",
            path=self._source,
            hint="if you wrote this checkpoint yourself and trust it, pass --trust-remote-pickle",
        )

    def persistent_load(self, pid):
        raise UnsafePickleError(f"unexpected persistent id {pid!r} in {self._short}", path=self._source)


def load_allowed(
    data: bytes,
    source: str,
    allowed: Mapping[tuple[str, str], object],
    *,
    trust: bool = False,
    what: str = "a pickle",
    short: str | None = None,
    parse_what: str = "pickle",
    corrupt_hint: str = "the file is corrupt",
) -> object:
    """`check_pickle_bounds`, then unpickle `data` resolving globals only through `allowed`. Any
    failure is an UnsafePickleError naming `source`."""
    with gc_paused():
        check_pickle_bounds(data, source, parse_what)
        try:
            return AllowListUnpickler(
                io.BytesIO(data), source, allowed, trust=trust, what=what, short=short
            ).load()
        except UnsafePickleError:
            raise
        except Exception as exc:  # truncated/garbled pickle: any of a dozen exception types
            raise UnsafePickleError(
                f"cannot parse {parse_what}: {type(exc).__name__}: {exc}", path=source, hint=corrupt_hint
            ) from None
