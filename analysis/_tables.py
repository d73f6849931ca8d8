"""Results that print as their Markdown table (``str(result)`` is ``result.table()``), and their JSON records."""

from __future__ import annotations

from dataclasses import asdict, fields, is_dataclass
from typing import Any


class Table:
    """A result whose ``str`` is its Markdown :meth:`table`."""

    def table(self) -> str:
        """The result as a Markdown table."""
        raise NotImplementedError(f"{type(self).__name__} must define table()")

    def __str__(self) -> str:
        return self.table()


def record(result: Any, *, derived: tuple[str, ...] = (), left_out: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON record of the dataclass ``result``: its ``derived`` properties, then every field but the ``left_out``
    ones; a dataclass value, and each dataclass of a list, as its dict.

    Args:
        result: a dataclass instance.
        derived: names of properties computed from the fields, recorded first.
        left_out: names of fields the record leaves out (tensors for the figures).

    Returns:
        ``{name: value}`` in that order.
    """
    names = [*derived, *(f.name for f in fields(result) if f.name not in left_out)]
    return {name: _plain(getattr(result, name)) for name in names}


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
