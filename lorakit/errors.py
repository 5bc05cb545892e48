"""Errors lorakit raises: one class per kind of failure, each naming the file and tensor,
what was expected and what was found."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

__all__ = ["PathLike", "LorakitError", "FormatError", "UnsafePathError", "AdapterError",
           "FuseError", "OutputExistsError", "ArgumentError"]

PathLike = Union[str, Path]


class LorakitError(Exception):
    """Base class of every error lorakit raises on purpose: a one-line ``message``, the
    ``file`` and ``tensor`` (or config key) concerned, ``expected`` / ``found`` and a
    ``hint`` to fix it."""

    def __init__(
        self,
        message: str,
        *,
        file: Optional[PathLike] = None,
        tensor: Optional[str] = None,
        expected: Optional[str] = None,
        found: Optional[str] = None,
        hint: Optional[str] = None,
    ) -> None:
        self.message = message
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        self.expected = expected
        self.found = found
        self.hint = hint
        super().__init__(self._format())

    def where(self, file: Optional[PathLike] = None, tensor: Optional[str] = None
              ) -> "LorakitError":
        """This error with ``file`` and ``tensor`` filled in where it named none."""
        return type(self)(self.message, file=self.file if self.file is not None else file,
                          tensor=self.tensor or tensor, expected=self.expected,
                          found=self.found, hint=self.hint)

    def _format(self) -> str:
        parts = [self.message]
        if self.file is not None:
            parts.append(f"  file: {self.file}")
        if self.tensor is not None:
            parts.append(f"  tensor: {self.tensor}")
        if self.expected is not None:
            parts.append(f"  expected: {self.expected}")
        if self.found is not None:
            parts.append(f"  found: {self.found}")
        if self.hint is not None:
            parts.append(f"  hint: {self.hint}")
        return "\n".join(parts)


class FormatError(LorakitError):
    """A file is not a valid safetensors file, index or config."""


class UnsafePathError(LorakitError):
    """A name in an index or config points outside the directory it belongs to."""


class AdapterError(LorakitError):
    """An adapter cannot be read, or does not fit the base checkpoint."""


class FuseError(LorakitError):
    """Fusion failed: non-finite values, overflow, or an unsupported layout."""


class OutputExistsError(LorakitError):
    """The output path exists and --force was not given, or is unsafe to write."""


class ArgumentError(LorakitError, ValueError):
    """A verb's argument (or its CLI flag) has a value outside what it allows.

    Raised by :meth:`bad` as one line naming the argument, the value given and what is
    allowed; a ``ValueError`` too, so ``except ValueError`` still catches it.
    """

    @classmethod
    def bad(cls, name: str, value: object, allowed: str, hint: Optional[str] = None
            ) -> "ArgumentError":
        return cls(f"bad value for {name}", tensor=None, expected=allowed,
                   found=repr(value), hint=hint)
