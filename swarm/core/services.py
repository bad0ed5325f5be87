"""The services one peer owns: at most one of each type, created on first use (`Services`).

A peer hosts per-peer state for the layers above it — the averaging RPCs of all its averagers,
its expert server, the training states it serves — and that state lives here, on the peer that
owns it, rather than in module-level maps keyed by peer. `Component` is what a peer stops, in
reverse order, when it shuts down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar, cast

from swarm.core.errors import ConfigError

S = TypeVar("S")


class Component(Protocol):
    """Something attached to a peer that must stop cleanly with it (experts save checkpoints, ...)."""

    async def ashutdown(self) -> None: ...


class Services:
    """One instance per service type, owned by one peer.

    Example::

        service = peer.services.get_or_create(AveragingService, lambda: AveragingService(peer))
    """

    def __init__(self) -> None:
        self._by_type: dict[type, object] = {}  # each value is an instance of its key

    def get(self, kind: type[S]) -> S | None:
        """The peer's service of type `kind`, or None."""
        return cast("S | None", self._by_type.get(kind))

    def get_or_create(self, kind: type[S], create: Callable[[], S]) -> S:
        """The peer's service of type `kind`, made by `create()` the first time it is asked for."""
        service = self.get(kind)
        if service is None:
            service = self._by_type[kind] = create()
        return service

    def add(self, service: S) -> S:
        """Registers `service` under its own type.

        Raises:
            ConfigError: The peer already has a service of that type.
        """
        kind = type(service)
        if kind in self._by_type:
            raise ConfigError(f"this peer already has a {kind.__name__}")
        self._by_type[kind] = service
        return service

    def remove(self, service: object) -> None:
        """Forgets `service` if it is the one registered under its type."""
        if self._by_type.get(type(service)) is service:
            del self._by_type[type(service)]

    def __contains__(self, kind: type) -> bool:
        return kind in self._by_type
