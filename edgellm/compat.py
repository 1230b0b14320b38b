"""What Python 3.11 added that edgellm uses, for 3.10 (JetPack 6's system Python)."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:

    class StrEnum(str, Enum):  # noqa: UP042 (3.10 has no enum.StrEnum)
        """3.11's StrEnum: members are their string values, str() and format() included."""

        def __str__(self) -> str:
            return str.__str__(self)

        def __format__(self, spec: str) -> str:
            return str.__format__(str(self), spec)

        @staticmethod
        def _generate_next_value_(name: str, start: int, count: int, last_values: list) -> str:
            return name.lower()


__all__ = ["StrEnum"]
