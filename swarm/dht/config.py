"""`DHTConfig`: every knob of the DHT in one frozen, validated dataclass.

Defaults follow Kademlia (k = 20, alpha = 3; Maymounkov & Mazières, IPTPS 2002, §2.3, §4) except
where swarm's use differs: values live minutes rather than days, so buckets are refreshed and
records republished every 10 minutes instead of hourly (§2.3, §2.5), and records are kept on
`num_replicas` = 5 nodes rather than k, as hivemind does, because every replica costs a store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.core.errors import ConfigError
from swarm.core.faults import FaultPlan
from swarm.core.serialization import MAX_VALUE_BYTES
from swarm.dht.diversity import PrefixDiversity
from swarm.dht.validation import RecordValidator


@dataclass(frozen=True)
class DHTConfig:
    """Configuration of one DHT node.

    Attributes:
        bucket_size: k, the most contacts per k-bucket and the number of nearest nodes a find
            returns and a `latest=True` get asks (§2.2, §2.3).
        alpha: Requests in flight at once per key during a lookup (§2.3), on each path.
        disjoint_paths: Paths sharing no node along which each lookup runs (S/Kademlia; see
            `swarm.dht.traversal`): lying nodes that refer only to one another then capture the
            paths that meet them, not the others. 1: plain Kademlia. Costs up to this many times
            the requests of a `latest=True` get or a node lookup (a get of any value starts with
            one request still); see BENCHMARKS.md.
        num_replicas: Nodes each record is stored on: the nearest to its key.
        depth_modulo: b of the relaxed bucket-splitting rule (§4.2).
        request_timeout: Deadline of each remote call, in seconds: the cap. A node whose link this
            peer measured gets `request_timeout_multiple` times its RFC 6298 retransmission
            timeout (SRTT + 4 RTTVAR, from the round trips of its answered DHT calls, as the
            caller sees them), within [`min_request_timeout`, `request_timeout`]; a node never
            measured gets `request_timeout`. A dead node on a fast link so costs a small
            multiple of its round trip, and a slow one is not given up on early.
        min_request_timeout: Floor of a measured node's request timeout, seconds (RFC 6298's
            1 s floor of the RTO); `request_timeout` wins where it is smaller. A request that
            times out doubles its node's timeout until the node answers again, and is sent once
            more with the doubled one while the first may still answer (`DHTProtocol`), so a
            link that became much slower after it was measured (1 ms, then 1.5 s:
            `tests/dht/test_replication.py`) still gets its answer, within `request_timeout`.
        request_timeout_multiple: See `request_timeout`.
        lookup_timeout: Deadline of a whole store or get, in seconds.
        refresh_interval: Buckets not touched for this long are refreshed by a lookup of a random
            ID in their range (§2.3); the refresh runs this often.
        republish_interval: Records are sent again to the nodes currently nearest to their key
            this often, unless a store for them arrived meanwhile (§2.5); records this node
            originated are republished until they expire.
        cache_size: Records kept from lookups (§2.3 caching); 0 disables the cache.
        cache_nearest: Nodes, nearest first, that get a copy of a found value they lacked.
        cache_max_age: Seconds a value this node holds only as a cached copy answers its own
            gets and other nodes' finds after it was fetched (or pushed here); later gets look
            the key up again (keeping the cached copy only as a fallback). Bounds how long a
            reader misses subkeys that other writers added to a dictionary since it was cached
            (an expert server that joined). 0: every such get looks the key up.
        storage_size: Most records (keys) this node keeps for others, so that no writer can fill
            its memory; past it, records expiring soonest make room. None: no limit.
        storage_bytes: Most bytes (values, subkeys and keys) this node keeps for others; past
            it, new records are refused. None: no limit.
        max_key_bytes: Most bytes one key (all its subkeys together) may hold on this node.
        max_subkeys: Most subkeys one key may hold on this node.
        max_writer_bytes: Most bytes this node keeps for one writer: the owner a record's key or
            subkey names (its signature proves it), else the caller that sent it.
        max_writer_records: Most records (values or subkeys) this node keeps for one writer.
        max_source_bytes: Most bytes this node keeps that arrived from one source network (the
            caller's /24 or /64, `swarm.net.server.source_of`; loopback is exempt), whatever
            identities it used: identities are free, networks are not.
        max_source_records: Most records this node keeps that arrived from one source network.
        source_store_rate: Store requests one source network may send per second (bursts of
            twice that pass); past it its stores are refused with RESOURCE_EXHAUSTED.
        source_find_rate: Find requests one source network may send per second, likewise.
        max_inflight_per_source: Store and Find requests handled at once from one source network.
        diversity: Sybil defence (`swarm.dht.diversity`): at most so many routing-table contacts
            per network prefix (per common ID prefix length and in all) and replicas of a record
            per prefix; loopback and private networks are exempt by default. None: no limit.
        max_expiration_ahead: How far ahead of now, in seconds, a record may expire; a store
            expiring later is refused, and a value found on the network that expires later is
            dropped (so a writer cannot make a record outlive its purpose, or win every
            comparison by expiration, with a far-future time).
        expiration_horizons: (key prefix, seconds) pairs that override `max_expiration_ahead`
            for keys starting with the prefix (the longest matching prefix wins).
        max_contacts_per_answer: Most nodes taken from one node's answer for one key; the rest
            of a longer list is ignored (a liar cannot flood a lookup with fake contacts).
            0: `bucket_size`.
        max_value_bytes: Largest serialized value accepted (signature included).
        max_keys_per_call: Most keys in one batched Find or Store request.
        blacklist_base_time: Ban, in seconds, of a peer after its first failed call; each
            further failure doubles it.
        blacklist_max_time: Longest ban, in seconds.
        leave_timeout: How long a node that shuts down waits, at most, for the nodes in its
            routing table to take note that it leaves (they drop it at once); 0: leave without
            a word, as a crash would.
        validators: Extra record validators (a `SchemaValidator`, ...); owner signatures are
            always checked (`SignatureValidator`).
        fault_plan: Injected link faults (tests and simulations only).
    """

    bucket_size: int = 20
    alpha: int = 3
    disjoint_paths: int = 2
    num_replicas: int = 5
    depth_modulo: int = 5
    request_timeout: float = 3.0
    min_request_timeout: float = 1.0
    request_timeout_multiple: float = 4.0
    lookup_timeout: float = 10.0
    refresh_interval: float = 600.0
    republish_interval: float = 600.0
    cache_size: int = 10_000
    cache_nearest: int = 1
    cache_max_age: float = 5.0
    storage_size: int | None = 100_000
    storage_bytes: int | None = 256 << 20
    max_key_bytes: int = 8 << 20
    max_subkeys: int = 4096
    max_writer_bytes: int = 32 << 20
    max_writer_records: int = 20_000
    max_source_bytes: int = 64 << 20
    max_source_records: int = 40_000
    source_store_rate: float = 1000.0
    source_find_rate: float = 4000.0
    max_inflight_per_source: int = 256
    diversity: PrefixDiversity | None = field(default_factory=PrefixDiversity)
    max_expiration_ahead: float = 86_400.0
    expiration_horizons: tuple[tuple[str, float], ...] = ()
    max_contacts_per_answer: int = 0
    max_value_bytes: int = MAX_VALUE_BYTES
    max_keys_per_call: int = 128
    blacklist_base_time: float = 5.0
    blacklist_max_time: float = 600.0
    leave_timeout: float = 0.5
    validators: tuple[RecordValidator, ...] = ()
    fault_plan: FaultPlan | None = None

    def expiration_horizon(self, key: str | bytes | None) -> float:
        """Seconds ahead of now that a record under `key` (the user's key) may expire at most."""
        best, horizon = -1, self.max_expiration_ahead
        if key is not None and self.expiration_horizons:
            text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            for prefix, seconds in self.expiration_horizons:
                if len(prefix) > best and text.startswith(prefix):
                    best, horizon = len(prefix), seconds
        return horizon

    def __post_init__(self) -> None:
        for name in ("bucket_size", "alpha", "disjoint_paths", "num_replicas", "depth_modulo", "max_keys_per_call"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DHTConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "lookup_timeout", "refresh_interval", "republish_interval",
                     "blacklist_base_time"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"DHTConfig.{name} must be > 0, got {getattr(self, name)}")
        if not (self.min_request_timeout > 0 and self.request_timeout_multiple >= 1):
            raise ConfigError("DHTConfig needs min_request_timeout > 0 and request_timeout_multiple >= 1")
        if self.blacklist_max_time < self.blacklist_base_time:
            raise ConfigError("DHTConfig.blacklist_max_time must be >= blacklist_base_time")
        if not self.leave_timeout >= 0:
            raise ConfigError(f"DHTConfig.leave_timeout must be >= 0, got {self.leave_timeout}")
        if self.cache_size < 0 or self.cache_nearest < 0:
            raise ConfigError("DHTConfig.cache_size and cache_nearest must be >= 0")
        if not self.cache_max_age >= 0:
            raise ConfigError(f"DHTConfig.cache_max_age must be >= 0, got {self.cache_max_age}")
        if self.storage_size is not None and self.storage_size < 1:
            raise ConfigError(f"DHTConfig.storage_size must be >= 1 or None, got {self.storage_size}")
        for name in ("max_key_bytes", "max_subkeys", "max_writer_bytes", "max_writer_records", "max_source_bytes",
                     "max_source_records", "max_inflight_per_source"):
            if getattr(self, name) < 1:
                raise ConfigError(f"DHTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not (self.source_store_rate > 0 and self.source_find_rate > 0):
            raise ConfigError("DHTConfig.source_store_rate and source_find_rate must be > 0")
        if self.storage_bytes is not None and self.storage_bytes < 1:
            raise ConfigError(f"DHTConfig.storage_bytes must be >= 1 or None, got {self.storage_bytes}")
        if not self.max_expiration_ahead > 0:
            raise ConfigError(f"DHTConfig.max_expiration_ahead must be > 0, got {self.max_expiration_ahead}")
        horizons = tuple((str(prefix), float(seconds)) for prefix, seconds in self.expiration_horizons)
        for prefix, seconds in horizons:
            if not seconds > 0:
                raise ConfigError(f"DHTConfig.expiration_horizons: {prefix!r} maps to {seconds}, not > 0")
        object.__setattr__(self, "expiration_horizons", horizons)
        if self.max_contacts_per_answer == 0:
            object.__setattr__(self, "max_contacts_per_answer", self.bucket_size)
        if self.max_contacts_per_answer < 1:
            raise ConfigError(f"DHTConfig.max_contacts_per_answer must be >= 1, got {self.max_contacts_per_answer}")
        if self.max_value_bytes < 1:
            raise ConfigError(f"DHTConfig.max_value_bytes must be >= 1, got {self.max_value_bytes}")
        validators = tuple(self.validators)
        for validator in validators:
            if not isinstance(validator, RecordValidator):
                raise ConfigError(f"DHTConfig.validators holds {validator!r}, not a RecordValidator")
        object.__setattr__(self, "validators", validators)
        if self.diversity is not None and not isinstance(self.diversity, PrefixDiversity):
            raise ConfigError(f"DHTConfig.diversity must be a PrefixDiversity or None, got {self.diversity!r}")
        if self.fault_plan is not None and not isinstance(self.fault_plan, FaultPlan):
            raise ConfigError(f"DHTConfig.fault_plan must be a FaultPlan, got {self.fault_plan!r}")
