"""Named extension points: a Registry maps each name to the object that defines it (a pipeline schedule, an
aggregation rule). A name written "package.module:attr" names one defined outside hetpipe: it is imported on
first use, in every process that meets the name, so a child process resolves the same string the same way.
Pure: no I/O beyond that import."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from hetpipe.core.errors import UsageError, did_you_mean
from hetpipe.core.imports import import_object

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> definitions of one kind (`what`, e.g. "schedule"), in registration order; `accepts` tells a
    definition of that kind from anything else a "package.module:attr" name may point at."""

    def __init__(self, what: str, plural: str, accepts: Callable[[object], bool], example: str) -> None:
        self.what, self.plural, self.example = what, plural, example
        self._accepts = accepts
        self._items: dict[str, T] = {}
        self._imported: dict[str, T] = {}  # "package.module:attr" -> what it names

    def register(self, name: str, item: T) -> T:
        """Make `item` known as `name`; ValueError when another definition has that name."""
        if not self._accepts(item):
            raise TypeError(f"{item!r} is not a {self.what}")
        if ":" in name:
            raise ValueError(f'{self.what} names may not hold ":" ({name!r}): that form names an import')
        if name in self._items:
            raise ValueError(f"{self.what} {name!r} is registered twice; pick another name")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        """Forget `name` (a test that registered a definition for its own use)."""
        self._items.pop(name, None)

    def get(self, name: str) -> T:
        """The definition of `name`: a registered one, or the one "package.module:attr" imports; UsageError
        naming the known names otherwise."""
        found = self._items.get(name)
        if found is None:
            found = self._imported.get(name)
        if found is not None:
            return found
        if ":" in name:
            item = import_object(name, f'{self.what} "{name}"', self.example)
            if not self._accepts(item):
                raise UsageError(f'"{name}" is not a {self.what}: name one such as "{self.example}"')
            self._imported[name] = item
            return item
        known = sorted(self._items)
        raise UsageError(
            f'unknown {self.what} "{name}"\n       known {self.plural}: {", ".join(known)}'
            f"{did_you_mean(name, known)}"
        )

    def names(self) -> list[str]:
        """The registered names, in registration order (imported "package.module:attr" names are not)."""
        return list(self._items)

    def items(self) -> list[tuple[str, T]]:
        return list(self._items.items())

    def values(self) -> list[T]:
        return list(self._items.values())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, name: str) -> T:
        return self.get(name)
