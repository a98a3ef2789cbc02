"""The one YAML loader of every settings file: PyYAML's safe loader, bounded.

`yaml.safe_load` takes the last of two equal keys without a word (a typo'd override silently
wins or loses), nests as deep as the file does and builds integers of any length (Python refuses
to turn one of more than 4300 digits into an `int` with a ValueError, far from the file). Here a
repeated key, nesting deeper than `MAX_DEPTH`, a scalar longer than `MAX_SCALAR` characters and an
integer of more than `MAX_DIGITS` digits are `yaml.YAMLError`s naming the line, which the readers
turn into one line naming the file."""
from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode

MAX_DEPTH = 64          # configs nest a handful of levels; 64 is far past any real one
MAX_SCALAR = 1 << 20    # characters in one value (task prompts are a few thousand)
MAX_DIGITS = 100        # an integer this long is no seed, size or count
MAX_ALIASES = 1000      # `*anchor` uses: bounds an alias bomb's expansion


class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type information
    """A `SafeLoader` that refuses repeated keys, deep nesting, huge scalars and alias bombs."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise ConstructorError(None, None, f"more than {MAX_ALIASES} aliases (*name)",
                                       self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ConstructorError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                       self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_scalar(self, node: ScalarNode) -> Any:
        value = super().construct_scalar(node)
        if isinstance(value, str) and len(value) > MAX_SCALAR:
            raise ConstructorError(None, None, f"a value of {len(value)} characters (at most {MAX_SCALAR})",
                                   node.start_mark)
        return value

    def construct_yaml_int(self, node: ScalarNode) -> int:
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_DIGITS:
            raise ConstructorError(None, None, f"an integer of {digits} digits (at most {MAX_DIGITS})",
                                   node.start_mark)
        return int(super().construct_yaml_int(node))

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the base class reports it
                if first is not None:
                    raise ConstructorError(None, None, f"key {key!r} appears twice (first on line "
                                           f"{first.line + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark
        mapping: dict[Any, Any] = super().construct_mapping(node, deep)
        return mapping


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def load_yaml(text: str) -> Any:
    """One YAML document, through `BoundedLoader`."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
