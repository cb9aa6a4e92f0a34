"""The ``advanced:`` section: what only a developer tunes, apart from what an operator sets.

An operator's file names the models, their endpoints and engine, the classes,
the tenants and the identity; everything here has a default measured for
Envoy's shape and is changed only to reproduce or study a limit. Keeping it
in one section keeps the reference's first tables to what a deployment needs.
A key that moved here from elsewhere is refused at its old place with its
new one (the sections' ``REMOVED``, values.py), never read from both.
"""

from __future__ import annotations

import msgspec

from extproc.adapters.config.values import Count, Count0, Positive, Section


class GrpcLimits(Section, frozen=True):
    """The gRPC port's bounds on what one peer can hold (adapters/grpc/transport.py ``TransportLimits``).

    Far above what Envoy's held requests need, each held request being one
    stream (docs/configuration.md, "The gRPC port's limits").
    """

    max_streams_per_connection: Count = 100_000
    max_connections: Count = 1_000
    connection_buffer_bytes: Count = 32 * 1024 * 1024
    idle_timeout_s: Positive = 3600.0
    handshake_timeout_s: Positive = 10.0
    # What a peer can make the HTTP/2 layer send, or read for nothing: Envoy's codec limits by their
    # names and defaults (config/core/v3/protocol.proto, Http2ProtocolOptions), nghttp2's for
    # CONTINUATION, Envoy's runtime keys for premature resets (docs/configuration.md, "Floods").
    output_buffer_bytes: Count = 1024 * 1024
    max_output_buffer_bytes: Count = 4 * 1024 * 1024
    max_outbound_frames: Count = 10_000
    max_outbound_control_frames: Count = 1_000
    max_consecutive_inbound_frames_with_empty_payload: Count0 = 1
    max_inbound_priority_frames_per_stream: Count0 = 100
    max_inbound_window_update_frames_per_data_frame_sent: Count = 10
    max_continuation_frames: Count0 = 8
    premature_reset_total_stream_count: Count = 500
    premature_reset_min_stream_lifetime_s: Positive = 1.0
    max_frames_per_read: Count = 512


# The keys that were `listen.*` before they moved to `advanced.grpc.*`.
GRPC_LIMITS = ("max_streams_per_connection", "max_connections", "connection_buffer_bytes", "idle_timeout_s",
               "handshake_timeout_s")


class ModelAdvanced(Section, frozen=True):
    """A model's ``advanced:`` section: how often its engines are read, and how the gate copes without them.

    The defaults suit an engine next to the processor; a developer changes
    them to study a slower scrape or a lagging engine (docs/gate.md).
    """

    # How often each endpoint's /metrics is read.
    scrape_interval_s: Positive = 0.1
    # Metrics older than this are not trusted (the engine may have moved on); also the scrape's timeout.
    stale_after_s: Positive = 1.0
    # In-flight floor per endpoint while the engine's metrics cannot be read.
    fallback_max_in_flight: Count = 4
    # Inter-token latency is averaged over this much recent time; also the least time between two cuts.
    itl_window_s: Positive = 2.0


# The model keys that moved to `models[].advanced.*`.
MODEL_ADVANCED = tuple(ModelAdvanced.__struct_fields__)


class AdvancedSettings(Section, frozen=True):
    """Developer tuning, one subsection per part of the program it bounds."""

    grpc: GrpcLimits = msgspec.field(default_factory=GrpcLimits)
