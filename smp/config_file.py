"""Reading a config file (.json / .yaml / .yml) into a dict, with bounded time and memory.

A config is a few dozen keys; anything far larger is a mistake or an attack, and must fail in
well under a second with one line naming the file, never with a traceback or a message that
echoes the input:
- only a regular file is opened (a FIFO would block `open()` forever), and it is read only up
  to `MAX_CONFIG_BYTES` (`/dev/zero` never ends);
- YAML aliases are expanded at most `MAX_YAML_NODES` nodes in all: a 561-byte "billion laughs"
  file expands to 10^9 nodes, which pydantic then walks (and quotes in its error);
- nesting is capped at `MAX_DEPTH` (the YAML composer and json recurse in Python);
- a key given twice in one mapping is an error (both parsers keep the last one silently).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from smp.errors import ConfigError
from smp.regular_files import NotReadable, read_regular

MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_NODES = 100_000
MAX_DEPTH = 64


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping a .json / .yaml / .yml file holds; ConfigError naming the file otherwise."""
    name = repr(str(path))[:300]
    if path.suffix not in (".json", ".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"config file {name} does not exist")
        raise ConfigError(f"config file {name}: use a .json, .yaml or .yml file")
    try:
        # Only a regular file, checked before opening (a FIFO blocks open() itself), read up to
        # the limit (/dev/zero never ends); a link to a regular file is fine.
        raw = read_regular(str(path), MAX_CONFIG_BYTES, follow_links=True)
    except NotReadable as e:
        why = str(e)
        if why == "is a directory, not a regular file":
            why = "is a directory; name a .json or .yaml file"
        elif why.startswith("is larger than"):
            why += "; a config is a few keys"
        elif why.startswith("is a"):
            why += "; name a .json or .yaml file"
        raise ConfigError(f"config file {name} {why}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {name} is not UTF-8 text: byte 0x{raw[e.start]:02x} on line {line}; save it as UTF-8"
        ) from None
    kind = path.suffix[1:]
    try:
        data = _parse_json(text) if kind == "json" else yaml.load(text, Loader=_BoundedLoader)  # noqa: S506
    except (json.JSONDecodeError, yaml.YAMLError, _TooLarge) as e:
        raise ConfigError(f"config file {name} is not valid {kind}: {_one_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name} must hold a mapping of keys, not {type(data).__name__}")
    return data


def parse_json_config(text: str, name: str) -> dict[str, Any]:
    """A config given as JSON text (e.g. in an environment variable), with the file's bounds:
    size, nesting depth, duplicate keys. `name` says where it came from, for the ConfigError."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{name} is longer than {MAX_CONFIG_BYTES >> 20} MiB; a config is a few keys")
    try:
        data = _parse_json(text)
    except (json.JSONDecodeError, _TooLarge) as e:
        raise ConfigError(f"{name} is not valid JSON: {_one_line(e)}; starts with {text[:100]!r}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must hold a JSON object of keys, not {type(data).__name__}")
    return data


class _TooLarge(ValueError):
    """Nesting or duplicate keys in JSON (yaml's own errors carry a position instead)."""


def _one_line(e: Exception) -> str:
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return f"{e.problem or e.context}{where}"[:300]
    return " ".join(str(e).split())[:300]


# ----------------------------------------------------------------------------------------------
# JSON


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_json_mapping)
    except RecursionError:
        raise _TooLarge(f"nested deeper than Python's recursion limit (a config nests {MAX_DEPTH} at most)") from None


def _json_mapping(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    mapping: dict[str, Any] = {}
    for key, value in pairs:
        if key in mapping:
            raise _TooLarge(f"key {key[:100]!r} appears twice in one object")
        mapping[key] = value
    return mapping


# ----------------------------------------------------------------------------------------------
# YAML


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that counts the nodes aliases expand to, caps the nesting depth and
    refuses a key given twice in one mapping."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._expanded = 0  # nodes composed so far, an alias counting as the nodes it stands for
        self._sizes: dict[int, int] = {}  # id(node) -> its expanded node count, for aliases
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            self._count(self._sizes.get(id(node), 1), node)
            return node
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
        before = self._expanded
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._count(1, node)
        self._sizes[id(node)] = self._expanded - before
        return node

    def _count(self, nodes: int, node: Any) -> None:
        self._expanded += nodes
        if self._expanded > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(
                None, None,
                f"aliases (*name) expand to more than {MAX_YAML_NODES} values; a config is a few keys",
                node.start_mark)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges; its keys may be overridden
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {str(key)[:100]!r} appears twice in one mapping", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)
