"""One configured model as the stream handling reads it: a narrow, read-only view of its runtime.

``adapters/runtime.py`` keeps everything the adapters hold for a model in one
``ModelRuntime`` (its dispatcher, scraper, signer, replies, statuses,
telemetry and retirement) and a reload updates or replaces that one object.
The servicer and the attachments read only what is below, so they depend on
neither the runtime nor how a reload changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.request.prompt_prefix import Signer
from extproc.adapters.telemetry import ModelTelemetry
from extproc.core.dispatcher import ModelDispatcher


class ServedModel(Protocol):
    """What a stream reads of the model its request names."""

    @property
    def name(self) -> str: ...

    @property
    def dispatcher(self) -> ModelDispatcher:
        """Where its requests are submitted and ended, and its engines' answers told."""

    @property
    def report(self) -> ModelTelemetry:
        """Where the adapters' events of it go (the core's go through its dispatcher)."""

    @property
    def signer(self) -> Signer | None:
        """Its prompts' prefix signatures (a model with ``prefix:``); None: its requests are not signed."""

    @property
    def hold_reply(self) -> pb.ProcessingResponse:
        """What keeps our own Envoy waiting while one of its requests is held (a message-timeout override)."""

    @property
    def full_statuses(self) -> frozenset[int]:
        """The statuses its engine answers with when its own queue is full (``release_outcome.py``)."""

    @property
    def stream_refusal(self) -> Callable[[Mapping[str, Any]], bool] | None:
        """How its engine refuses inside a stream's 200, where its streams' start is checked; None: not checked."""

    @property
    def checks_start_if_capped(self) -> bool:
        """Whether that check waits for an engine of the pool to say it caps what it holds (``check_stream_start`` unset)."""

    def engine_priority(self, band: int) -> int | None:
        """The body ``priority`` to write for a request of ``band`` (negated for engines that run higher values
        first); None where none is written."""
