"""Robust averaging with 8 real in-process peers on loopback: byzantine contributors, a lying reducer.

Byzantine members send finite but poisoned tensors (x1000, sign-flipped, random, a constant
direction). In robust mode (CenteredClip, verified) every member ends with the same result, and
that result lies within the bound of swarm/averaging/robust.py of the honest members' mean; the
plain mean of the same inputs is moved far past it. A reducer that shifts its result is caught by
the members' checks and named on every member, whose tensors stay untouched.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from avg_harness import run_steps

from swarm.averaging import (
    Action,
    AllReduceConfig,
    Averager,
    AveragerConfig,
    FaultPlan,
    FaultPoint,
    MatchmakingConfig,
)
from swarm.averaging.reputation import Reputation, ReputationConfig
from swarm.averaging.verification import ReducerLied
from swarm.compression import CompressionType
from swarm.core.errors import ConfigError
from swarm.peer import Peer

N = 8
SIZE = 24_000
# rounds get at least 10 s: 8 peers on a loaded 2-core machine need more than the 1 s floor
ROOMY = MatchmakingConfig(min_round_timeout=10.0)
ROBUST = AveragerConfig(allreduce=AllReduceConfig(aggregation="centered_clip", chunk_bytes=16384), matchmaking=ROOMY)
PLAIN = AveragerConfig(allreduce=AllReduceConfig(chunk_bytes=16384), matchmaking=ROOMY)
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def group():
    peers = [Peer() for _ in range(N)]
    yield peers
    for p in peers:
        p.shutdown()


def _averagers(peers, tensors, config, faults=None):
    addrs = [p.addrs[0] for p in peers]
    prefix = f"r{next(_prefixes)}"
    return [Averager(p, t, prefix=prefix, target_group_size=N, initial_group=addrs, config=config,
                     faults=(faults or {}).get(i)) for i, (p, t) in enumerate(zip(peers, tensors))]


def _round(peers, inputs, config, faults=None, tamper=None):
    tensors = [[x.clone()] for x in inputs]
    avgs = _averagers(peers, tensors, config, faults)
    if tamper is not None:
        tamper(avgs)
    try:
        results = run_steps(avgs, timeout=20.0)
    finally:
        for a in avgs:
            a.shutdown()
    return results, [t[0] for t in tensors]


def _honest_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(SIZE, generator=gen)
    return [base + 0.1 * torch.randn(SIZE, generator=gen) for _ in range(N)]


def _attack(kind, honest, i):
    if kind == "x1000":
        return honest[i] * 1000
    if kind == "sign_flip":
        return -honest[i]
    if kind == "random":
        return torch.randn(SIZE, generator=torch.Generator().manual_seed(100 + i)) * 30
    return torch.full((SIZE,), 3.0)  # a constant direction, the same from every attacker


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n_bad", [1, 2])
@pytest.mark.parametrize("kind", ["x1000", "sign_flip", "random", "constant"])
def test_byzantine_contributors_move_robust_mode_at_most_the_bound(group, kind, n_bad):
    honest = _honest_inputs(seed=n_bad)
    inputs = list(honest)
    bad = list(range(N - n_bad, N))  # the last members attack (any of them may lead)
    for i in bad:
        inputs[i] = _attack(kind, honest, i)
    honest_mean = sum(honest[i] for i in range(N) if i not in bad) / (N - n_bad)

    results, outputs = _round(group, inputs, ROBUST)
    assert all(not isinstance(r, Exception) for r in results), results
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])  # the same on every member
    r = results[0]
    assert all(res.clipped == r.clipped and res.clip_tau == r.clip_tau for res in results)
    ids = [p.peer_id for p in group]
    assert all(r.clipped[ids[i]] == 0.0 for i in range(N) if i not in bad), r.clipped  # honest: within tau
    assert all(r.clipped[ids[i]] > 0.5 for i in bad), r.clipped
    # per part: ||result - honest mean|| <= W_bad / W_honest * tau * (1 + tolerance) (robust.py)
    share = n_bad / (N - n_bad)
    bound = math.sqrt(sum((share * tau * (1 + 1e-3)) ** 2 for tau in r.clip_tau))
    error = float((outputs[0] - honest_mean).norm())
    assert error <= bound, (error, bound)

    plain_results, plain_outputs = _round(group, inputs, PLAIN)
    assert all(not isinstance(x, Exception) for x in plain_results), plain_results
    plain_error = float((plain_outputs[0] - honest_mean).norm())
    assert plain_error > 5 * bound, (plain_error, bound)
    assert plain_results[0].clipped == {} and plain_results[0].clip_tau == ()


@pytest.mark.timeout(120)
def test_a_lying_reducer_is_caught_and_named_on_every_member(group):
    inputs = _honest_inputs(seed=7)
    liar = 3
    faults = {liar: FaultPlan().add(FaultPoint.BEFORE_ALL_GATHER, Action.LIE, seconds=0.05)}
    results, outputs = _round(group, inputs, ROBUST, faults)
    for i, res in enumerate(results):
        assert isinstance(res, ReducerLied), (i, res)
        assert res.peer_id == group[liar].peer_id, res
        assert "not the published combination" in str(res), res
        assert torch.equal(outputs[i], inputs[i])  # nothing applied


@pytest.mark.timeout(120)
def test_a_reducer_that_inflates_the_automatic_radius_is_caught_and_named(group):
    # The liar runs modified settings after grouping (same schema as everyone): its CenteredClip
    # uses ten times the agreed radius, which would let member 7's x1000 input through ten times
    # as far; its published scales and combination are consistent with that radius.
    inputs = _honest_inputs(seed=11)
    inputs[7] = inputs[7] * 1000
    liar = 2

    def tamper(avgs):
        cfg = avgs[liar].config
        avgs[liar].config = dataclasses.replace(cfg, allreduce=dataclasses.replace(cfg.allreduce, clip_tau_scale=10.0))

    results, outputs = _round(group, inputs, ROBUST, tamper=tamper)
    for i, res in enumerate(results):
        assert isinstance(res, ReducerLied), (i, res)
        assert res.peer_id == group[liar].peer_id, res
        assert "exceeds what the inputs' spread allows" in str(res), res
        assert torch.equal(outputs[i], inputs[i])  # nothing applied


def test_reputation_unit_strikes_exclude_for_a_while_then_forgive():
    now = [0.0]
    rep = Reputation("me", ReputationConfig(clip_threshold=0.5, strikes=2, window=3, exclusion=60.0), lambda: now[0])
    assert rep.observe({"bad": 0.9, "good": 0.0, "me": 1.0}) == []
    assert rep.observe({"bad": 0.2, "good": 0.6}) == []
    assert rep.observe({"bad": 0.95, "good": 0.0}) == ["bad"]
    assert rep.refusal("bad") is not None and rep.refusal("good") is None and not rep.excluded("me")
    now[0] = 61.0
    assert rep.refusal("bad") is None


@pytest.mark.timeout(120)
def test_a_contributor_clipped_hard_in_several_rounds_is_kept_out_of_the_leaders_groups():
    peers = [Peer() for _ in range(4)]
    try:
        leader = min(range(4), key=lambda i: peers[i].peer_id)  # a static group's leader
        bad = (leader + 1) % 4
        config = AveragerConfig(allreduce=AllReduceConfig(aggregation="centered_clip"), matchmaking=ROOMY,
                                reputation=ReputationConfig(strikes=2, window=2, exclusion=600.0))
        honest = _honest_inputs(seed=3)[:4]
        tensors = [[x.clone()] for x in honest]
        addrs = [p.addrs[0] for p in peers]
        avgs = [Averager(p, t, prefix="rep", target_group_size=4, initial_group=addrs, config=config)
                for p, t in zip(peers, tensors)]
        for _ in range(2):
            for i, t in enumerate(tensors):
                t[0].copy_(honest[i] * (1000 if i == bad else 1))
            results = run_steps(avgs, timeout=20.0)
            assert all(not isinstance(r, Exception) for r in results), results
            assert results[0].clipped[peers[bad].peer_id] > 0.5
        assert avgs[leader].reputation.excluded(peers[bad].peer_id)
        results = run_steps(avgs, timeout=4.0, expected_size=3)
        assert isinstance(results[bad], Exception), results[bad]
        for i in range(4):
            if i != bad:
                assert not isinstance(results[i], Exception), results[i]
                assert peers[bad].peer_id not in results[i].group
    finally:
        for p in peers:
            p.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("excluded_role", ["leader", "member"])
def test_a_follower_does_not_average_with_a_peer_its_reputation_excluded(excluded_role):
    # A follower whose reputation excluded the leader does not join its group; one that finds an
    # excluded peer in the group the leader formed leaves it (that round fails for the others,
    # who lose the part it reduces) and stays away from that leader. Either way the others then
    # average without it and its tensors stay as they were.
    peers = [Peer() for _ in range(4)]
    try:
        order = sorted(range(4), key=lambda i: peers[i].peer_id)
        leader, follower, other = order[0], order[2], order[1]  # the static group's leader is the smallest
        excluded = leader if excluded_role == "leader" else other
        inputs = _honest_inputs(seed=13)[:4]
        tensors = [[x.clone()] for x in inputs]
        addrs = [p.addrs[0] for p in peers]
        avgs = [Averager(p, t, prefix=f"refuse-{excluded_role}", target_group_size=4, initial_group=addrs,
                         config=ROBUST) for p, t in zip(peers, tensors)]
        for _ in range(ROBUST.reputation.strikes):
            avgs[follower].reputation.observe({peers[excluded].peer_id: 1.0})
        assert avgs[follower].reputation.excluded(peers[excluded].peer_id)
        if excluded_role == "member":
            # as with a leader that ignores `JoinRequest.excludes` (the next test: one that reads it)
            avgs[follower].matchmaking.excluding = None
            results = run_steps(avgs, timeout=8.0, expected_size=4)
            assert all(isinstance(r, Exception) for r in results), results
            assert all(torch.equal(t[0], x) for t, x in zip(tensors, inputs))
        results = run_steps(avgs, timeout=8.0, expected_size=3)
        assert isinstance(results[follower], Exception), results[follower]
        assert torch.equal(tensors[follower][0], inputs[follower])
        rest = [i for i in range(4) if i != follower]
        assert all(not isinstance(results[i], Exception) for i in rest), results
        mean = sum(inputs[i] for i in rest) / 3
        for i in rest:
            assert float((tensors[i][0] - mean).norm()) < 1e-3 * float(mean.norm()), i  # without the follower
    finally:
        for p in peers:
            p.shutdown()


@pytest.mark.timeout(60)
def test_a_leader_keeps_a_follower_apart_from_the_peer_it_excludes_and_the_round_goes_on():
    # The follower names the peer its reputation excluded in its join request; the leader forms
    # its group without one of the two (the later of them to ask: each is in one conflict), so no
    # member leaves the group it was given and nobody's round fails for it.
    peers = [Peer() for _ in range(4)]
    try:
        order = sorted(range(4), key=lambda i: peers[i].peer_id)
        leader, other, follower = order[0], order[1], order[2]
        inputs = _honest_inputs(seed=17)[:4]
        tensors = [[x.clone()] for x in inputs]
        addrs = [p.addrs[0] for p in peers]
        avgs = [Averager(p, t, prefix="apart", target_group_size=4, initial_group=addrs, config=ROBUST)
                for p, t in zip(peers, tensors)]
        for _ in range(ROBUST.reputation.strikes):
            avgs[follower].reputation.observe({peers[other].peer_id: 1.0})
        assert avgs[follower].reputation.excluded_peers() == [peers[other].peer_id]
        results = run_steps(avgs, timeout=8.0, expected_size=4)
        assert not isinstance(results[leader], Exception), results[leader]
        group = results[leader].group
        assert len(group) == 3 and not {peers[other].peer_id, peers[follower].peer_id} <= set(group), group
        left_out = next(i for i in (other, follower) if peers[i].peer_id not in group)
        assert isinstance(results[left_out], Exception), results[left_out]
        assert torch.equal(tensors[left_out][0], inputs[left_out])
        members = [i for i in range(4) if i != left_out]
        mean = sum(inputs[i] for i in members) / 3
        for i in members:
            assert not isinstance(results[i], Exception), (i, results[i])
            assert float((tensors[i][0] - mean).norm()) < 1e-3 * float(mean.norm()), i
    finally:
        for p in peers:
            p.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [ROBUST, PLAIN], ids=["robust", "plain"])
def test_a_verified_robust_round_goes_on_without_a_member_that_never_shows(group, config):
    inputs = _honest_inputs(seed=11)
    leader = min(range(N), key=lambda i: group[i].peer_id)
    absent = (leader + 1) % N
    tensors = [[x.clone()] for x in inputs]
    avgs = _averagers(group, tensors, config)
    present = [a for i, a in enumerate(avgs) if i != absent]
    try:
        results = run_steps(present, timeout=20.0, expected_size=N - 1)
    finally:
        for a in avgs:
            a.shutdown()
    assert all(not isinstance(r, Exception) for r in results), results
    assert all(group[absent].peer_id not in r.group for r in results)
    outs = [t[0] for i, t in enumerate(tensors) if i != absent]
    assert all(torch.equal(o, outs[0]) for o in outs)
    honest_mean = sum(inputs[i] for i in range(N) if i != absent) / (N - 1)
    assert float((outs[0] - honest_mean).norm()) < 1e-3 * float(honest_mean.norm())  # nobody clipped
    assert torch.equal(tensors[absent][0], inputs[absent])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", [CompressionType.UNIFORM_8BIT, CompressionType.UNIFORM_4BIT])
def test_robust_mode_with_a_lossy_codec_and_a_client_mode_member_passes_its_checks(codec):
    peers = [Peer(client_mode=(i == 3)) for i in range(4)]
    try:
        inputs = _honest_inputs(seed=5)[:4]
        inputs[2] = inputs[2] * 1000
        tensors = [[x.clone()] for x in inputs]
        config = AveragerConfig(allreduce=AllReduceConfig(aggregation="centered_clip", chunk_bytes=16384),
                                compression=codec, matchmaking=ROOMY)
        addrs = [p.addrs[0] for p in peers if p.addrs]
        avgs = [Averager(p, t, prefix="lossy", target_group_size=4, initial_group=addrs, config=config)
                for p, t in zip(peers, tensors)]
        results = run_steps(avgs, timeout=20.0)
        assert all(not isinstance(r, Exception) for r in results), results
        assert all(torch.equal(t[0], tensors[0][0]) for t in tensors)
        assert results[0].clipped[peers[2].peer_id] > 0.5
        honest = (inputs[0] + inputs[1] + inputs[3]) / 3
        assert float((tensors[0][0] - honest).norm()) < 0.5 * float(honest.norm())
    finally:
        for p in peers:
            p.shutdown()


def test_one_caught_lie_never_excludes_a_reducer_two_of_this_peers_own_do_and_relayed_ones_never():
    now = [0.0]
    rep = Reputation("me", ReputationConfig(lies=2, window=4, exclusion=60.0), lambda: now[0])
    caught_here = ReducerLied(b"r" * 16, "reducer", "me", "part 1: the part is not the published combination")
    relayed = ReducerLied(b"r" * 16, "other", "someone", "part 2: the part is not the published combination")
    assert rep.observe_lie(caught_here) is False and not rep.excluded("reducer")  # one false accusation: no harm
    for _ in range(5):
        assert rep.observe_lie(relayed) is False  # another member's word (or a lying leader's) never counts
    assert not rep.excluded("other")
    assert rep.observe_lie(caught_here) is True and rep.refusal("reducer") is not None
    now[0] = 61.0
    assert rep.refusal("reducer") is None
    # a strike ages out: two lies further apart than `window` observed rounds do not exclude
    assert rep.observe_lie(caught_here) is False
    for _ in range(4):
        rep.observe({"reducer": 0.0})
    assert rep.observe_lie(caught_here) is False and not rep.excluded("reducer")
    with pytest.raises(ConfigError):
        ReputationConfig(lies=1)
