"""Results that print as their Markdown table: ``str(result)`` is ``result.table()``."""

from __future__ import annotations


class Table:
    """A result whose ``str`` is its Markdown :meth:`table`."""

    def table(self) -> str:
        """The result as a Markdown table."""
        raise NotImplementedError(f"{type(self).__name__} must define table()")

    def __str__(self) -> str:
        return self.table()
