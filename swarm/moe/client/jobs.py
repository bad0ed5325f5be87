"""Planning a mixture batch's expert calls: one job per chosen expert, one group call per server.

Each expert chosen by any sample gets one job carrying every (sample, slot) pair that chose it
(hivemind sends one request per sample and expert). The jobs of one server travel in one group
call (`swarm.moe.group_calls`): the rows any of them needs are sent once, and each expert takes
its share of them by index, or all of them (no index sent) when it needs every one, which is the
common case of a small grid where each sample chooses every expert.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from swarm.moe.client.beam_search import ExpertChoice

__all__ = ["ExpertJob", "ServerShare", "new_graph_id", "plan_jobs", "plan_shares"]


def new_graph_id() -> int:
    """A random id naming one forward pass (63 bits, so msgpack carries it as an int)."""
    return random.getrandbits(63)


@dataclass(frozen=True)
class ExpertJob:
    """One expert's share of a batch: which (sample, slot) pairs chose it.

    Attributes:
        uid: the expert.
        addr: its server.
        rows: the samples, strictly increasing.
        slots: the slot each of those samples put the expert in.
        graph_id: names the forward whose graph the server may keep for the backward.
    """

    uid: str
    addr: str
    rows: torch.Tensor
    slots: torch.Tensor
    graph_id: int | None


def plan_jobs(choice: ExpertChoice, keep_graphs: bool) -> list[ExpertJob]:
    """Groups the chosen (sample, slot) pairs by expert: one job per expert."""
    codes = choice.codes.masked_fill(~choice.valid, -1)
    jobs = []
    for code, (uid, addr) in sorted(choice.experts.items()):
        rows, slots = (codes == code).nonzero(as_tuple=True)  # row-major: rows increase, none twice
        if rows.numel():
            jobs.append(ExpertJob(uid, addr, rows, slots, new_graph_id() if keep_graphs else None))
    return jobs


@dataclass(frozen=True)
class ServerShare:
    """The jobs of one server, sent as one group call.

    Attributes:
        addr: the server.
        jobs: indices of its jobs in the batch's job list.
        rows: the batch rows any of its jobs needs, strictly increasing (None: every row).
        member_rows: per job, the indices of its rows within `rows` (None: all of them).
    """

    addr: str
    jobs: tuple[int, ...]
    rows: torch.Tensor | None
    member_rows: tuple[torch.Tensor | None, ...]


def plan_shares(jobs: list[ExpertJob], batch: int) -> list[ServerShare]:
    """Groups jobs by server, in the order of their first job."""
    by_addr: dict[str, list[int]] = {}
    for j, job in enumerate(jobs):
        by_addr.setdefault(job.addr, []).append(j)
    shares = []
    for addr, indices in by_addr.items():
        if any(jobs[j].rows.numel() == batch for j in indices):
            union = None
        else:
            union = torch.unique(torch.cat([jobs[j].rows for j in indices]))  # sorted
            if union.numel() == batch:
                union = None
        size = batch if union is None else union.numel()
        member_rows = tuple(
            None if jobs[j].rows.numel() == size
            else jobs[j].rows if union is None
            else torch.searchsorted(union, jobs[j].rows)
            for j in indices
        )
        shares.append(ServerShare(addr, tuple(indices), union, member_rows))
    return shares
