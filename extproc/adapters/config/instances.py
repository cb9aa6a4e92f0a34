"""The sections of a deployment with several processor instances: per-model shards, or an active-active cluster.

Each instance runs the same file; these sections say where each listens and
what it schedules (docs/cluster.md). The rules between them (one owner per
model, no address twice, a cluster's gates and policies) are in rules.py.
"""

from __future__ import annotations

import msgspec

from extproc.adapters.config.values import Address, Count, Names, NonEmpty, Positive, RedisUrl, Section


class Shard(Section, frozen=True):
    """One processor instance of a sharded deployment: where it listens and the models it alone schedules.

    Every instance runs the same file with ``extproc serve --shard NAME``;
    its ``listen`` is the shard's, its models only the shard's (docs/cluster.md).
    ``grpc`` is also where Envoy reaches it (a wildcard host means loopback).
    """

    grpc: Address
    metrics: Address
    models: Names


class ClusterInstance(Section, frozen=True):
    """One active-active instance: where it listens (``extproc serve --instance NAME``).

    ``grpc`` is also where Envoy reaches it (a wildcard host means loopback).
    """

    grpc: Address
    metrics: Address
    # With batches: where this instance serves the batch API (its batches.listen); Envoy's API cluster lists them all.
    batches: Address | None = None


# Renewals per lease when heartbeat_s is unset: the lease survives three late ones.
HEARTBEATS_PER_LEASE = 4


class ClusterSettings(Section, frozen=True):
    """Active-active: instances that share each engine's limit and the fairness counters through Redis.

    Instances whose files are identical except ``listen`` and that name the
    same ``redis_url`` (and ``key_prefix``) form one cluster (docs/cluster.md).
    """

    redis_url: RedisUrl
    # Every Redis key starts with this, so several clusters can share one Redis.
    key_prefix: NonEmpty = "extproc"
    # An instance's in-flight reservations lapse this long after its last word:
    # the slots of a dead instance come back.
    lease_s: Positive = 2.0
    # How often an idle instance renews its lease (a busy one renews with its releases);
    # None: lease_s / 4 (heartbeat_interval_s), so three renewals may be late before it lapses.
    heartbeat_s: Positive | None = None
    # A Redis call slower than this counts as Redis unreachable (the instance goes degraded).
    redis_timeout_ms: Count = 250
    # Optional: instance name -> its addresses, for `serve --instance` and Envoy's cluster.
    instances: dict[str, ClusterInstance] = msgspec.field(default_factory=dict)

    @property
    def heartbeat_interval_s(self) -> float:
        """How often an idle instance renews its lease: ``heartbeat_s``, else a quarter of the lease."""
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / HEARTBEATS_PER_LEASE
