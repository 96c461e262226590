"""`Registry`: the classes of one kind (methods, eviction policies) by name, filled by a class decorator.

Config validation, the CLI's choices and error messages all read the same registry, so a class joins
everywhere by being decorated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Named classes of one kind.

    Args:
        kind: what the names are, in the plural, for messages ("methods", "eviction policies").
        attribute: the class attribute the decorator sets to the class's registered name.
    """

    def __init__(self, kind: str, attribute: str = "name") -> None:
        self.kind = kind
        self.attribute = attribute
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: make `cls` available as `name`."""

        def decorate(cls: T) -> T:
            if name in self._classes:
                raise ValueError(
                    f"{name!r} is already registered among the {self.kind}: {self._classes[name]}."
                )
            setattr(cls, self.attribute, name)
            self._classes[name] = cls
            return cls

        return decorate

    def __getitem__(self, name: str) -> T:
        try:
            return self._classes[name]
        except KeyError:
            available = ", ".join(self.names())
            raise ConfigError(f"Unknown {name!r}. Available {self.kind}: {available}.") from None

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._classes))
