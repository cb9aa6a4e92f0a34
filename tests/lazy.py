"""The OpenAI SDK for the tests, imported when a test first uses it, not when pytest collects the module.

Every xdist worker collects every test module, so a library imported at the
top of a test module is imported by each worker, whatever tests it runs: the
SDK costs each about a second of CPU, a few seconds of the unit tier on two
cores where few of its tests use it. ``from tests.lazy import openai`` gives the
module itself to mypy and, at run time, a stand-in that imports it on the
first attribute a test reads (names with a leading underscore excepted: pytest
looks for its own markers on everything a module holds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


class _Lazy:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)


if TYPE_CHECKING:
    import openai as openai
else:
    openai = _Lazy("openai")
