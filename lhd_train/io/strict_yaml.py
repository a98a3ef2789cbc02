"""The one YAML loader of every settings file: PyYAML's safe loader, refusing repeated keys.

`yaml.safe_load` takes the last of two equal keys without a word (a typo'd override silently
wins or loses): here a repeated key is a `yaml.YAMLError` naming the line, which the readers turn
into one line naming the file. An integer past Python's digit limit or nesting past the parser's
depth limit (only a file made to break the loader has either) becomes such an error too.

Settings files are the user's own (docs/formats.md, "Threat model"): bounds against a file crafted
to exhaust memory (alias bombs, huge values) go past that model and are not kept."""
from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, ScalarNode

# libyaml's parser where PyYAML was built with it: the pure-Python scanner takes ~45 s over a 20 MB
# value (a pasted file in the wrong field), libyaml a fraction of a second; the constructor, and so
# every check below, is the same Python code either way.
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class BoundedLoader(_SAFE_LOADER):  # type: ignore[misc]  # PyYAML ships no type information
    """A safe loader that refuses repeated keys."""

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


def load_yaml(text: str) -> Any:
    """One YAML document, through `BoundedLoader`."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    except ValueError as e:  # an integer of thousands of digits
        raise yaml.YAMLError(f"cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    except RecursionError:  # the Python parser or constructor, one call per level (libyaml stops at 1000)
        raise yaml.YAMLError("cannot be read (nested deeper than Python's recursion limit)") from None
    finally:
        loader.dispose()
