"""What one store yields: each record's `StoreOutcome`, and the ledger that settles them.

A record's outcome is settled (reported to the caller, once, as a copy) when `StoreOperation`
(`store_operation.py`) says so, or when every answer it waits for is in; later answers go on
updating the original.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StoreOutcome:
    """What became of one record sent to the DHT, when its outcome was settled.

    Attributes:
        stored: Nodes that stored it (this one included).
        kept_here: This node stored a replica itself.
        outdated: Nodes that already held a value expiring as late or later.
        rejected: `PeerID: reason` for each node whose validators refused it.
        unanswered: Nodes that did not answer.
    """

    stored: int = 0
    kept_here: bool = False
    outdated: int = 0
    rejected: list[str] = field(default_factory=list)
    unanswered: int = 0

    def __bool__(self) -> bool:
        return self.stored > 0

    def copy(self) -> StoreOutcome:
        return StoreOutcome(self.stored, self.kept_here, self.outdated, list(self.rejected), self.unanswered)


class OutcomeLedger:
    """The outcomes of one store's records, and which of them are settled.

    Args:
        count: How many records the store carries.
        on_result: Called with (index, outcome) as each record's outcome is settled.
    """

    def __init__(self, count: int, on_result: Callable[[int, StoreOutcome], None] | None) -> None:
        self.on_result = on_result
        self.settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done once every record's outcome is settled (or with the error that ended the store)."""
        self.outcomes = [StoreOutcome() for _ in range(count)]
        self.pending = [0] * count  # answers (and the key's lookup) each record still waits for
        self.reported: list[StoreOutcome | None] = [None] * count
        self.unsettled = count
        self.failed = False

    def results(self) -> list[StoreOutcome]:
        """Each record's outcome as it was settled (as it stands, for one not settled yet)."""
        return [reported if reported is not None else outcome for reported, outcome in zip(self.reported, self.outcomes)]

    def settle(self, index: int) -> None:
        """Reports a record's outcome (once): a copy, as later answers go on updating the original."""
        if self.reported[index] is not None or self.failed:
            return
        outcome = self.reported[index] = self.outcomes[index].copy()
        self.unsettled -= 1
        if self.on_result is not None:
            self.on_result(index, outcome)
        if self.unsettled == 0 and not self.settled.done():
            self.settled.set_result(None)

    def release(self, index: int) -> None:
        """One awaited answer (or the key's lookup) is in; the outcome is final when none are left."""
        self.pending[index] -= 1
        if self.pending[index] == 0:
            self.settle(index)

    def fail(self, error: Exception) -> None:
        """Ends the store with `error`: the caller sees it instead of outcomes, and none is reported."""
        self.settled.set_exception(error)
        self.failed = True
