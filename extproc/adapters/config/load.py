"""Loading: a YAML file (or an already-loaded document) checked and resolved, each mistake with its line.

Every mistake is reported at once, each as ``FILE:LINE: key.path: problem``
(``config.yaml:12: models[1].target_waiting: must be an integer >= 1, got
'three'``), in the file's order, so an operator fixes them top to bottom.
validate.py converts the document into the schema's structs and names each
mistake by its key path; this module finds the line where that key is
written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from extproc.adapters.config.resolve import Config, ConfigError, resolve
from extproc.adapters.config.rules import RULES
from extproc.adapters.config.schema import ConfigFile
from extproc.adapters.config.validate import Invalid, convert


def parse_config(raw: Any) -> Config:
    """Validate an already-loaded YAML document; a ConfigError lists every mistake."""
    try:
        return _parse(raw)
    except Invalid as exc:
        raise ConfigError(*exc.errors) from None


def _parse(raw: Any) -> Config:
    """``raw`` as the program reads it; :class:`Invalid` lists every mistake with its key path."""
    return resolve(convert(raw, ConfigFile, RULES))


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML file; every failure is a ConfigError, each line ``FILE:LINE: key.path: problem``.

    The line is where the offending key (or list item) is written; a missing
    key points at the mapping that lacks it. The lines come from PyYAML's
    node tree (its start marks), composed once and then constructed, so the
    file is parsed a single time.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    return parse_config_text(path, text)


def parse_config_text(path: str | Path, text: str) -> Config:
    """The file ``path`` whose content is ``text`` (already read: a reload hashes what it parses), as load_config."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        raw = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_error(path, exc)) from None
    finally:
        loader.dispose()
    try:
        return _parse(raw)
    except Invalid as exc:
        lines = _key_lines(node)
        located = sorted(((_line(lines, key), error) for (key, _), error in zip(exc.problems, exc.errors, strict=True)),
                         key=lambda pair: pair[0])  # in the file's order, for reading top to bottom
        raise ConfigError(*(f"{path}:{line}: {error}" for line, error in located)) from None


def _yaml_error(path: str | Path, exc: yaml.MarkedYAMLError) -> str:
    """PyYAML's error as one line naming the file (its own says ``<unicode string>``)."""
    mark = exc.problem_mark or exc.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    context = f" ({exc.context})" if exc.context else ""
    return f"{where}: not valid YAML: {exc.problem}{context}"


def _key_lines(root: yaml.Node | None) -> dict[str, int]:
    """Key path (as validate.py spells it) -> the 1-based line where it is written."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = f"{path}.{key.value}" if path else str(key.value)
                lines.setdefault(child, key.start_mark.line + 1)
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                child = f"{path}[{i}]"
                lines.setdefault(child, item.start_mark.line + 1)
                walk(item, child)

    if root is not None:
        lines[""] = root.start_mark.line + 1
        walk(root, "")
    return lines


def _line(lines: dict[str, int], key: str) -> int:
    """The line of ``key``, else of the nearest enclosing key that is written (1 for an empty file)."""
    while key not in lines and key:
        key = key[: max(key.rfind("."), key.rfind("["), 0)]
    return lines.get(key, 1)
