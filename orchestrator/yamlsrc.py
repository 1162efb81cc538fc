"""YAML loading that remembers where every value came from.

`load_yaml(text, file)` returns plain Python data plus a `Source` that maps a
field path (tuple of keys / list indices) to its 1-based line, so that a
validation error can say `cluster.yaml:12: job.comand: unknown key`.
Safe loading only; duplicate keys are an error (YAML would keep the last one
silently, which hides typos just like an unknown key would).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import Location, SpecError

Path_ = tuple[Any, ...]


@dataclass
class Source:
    file: str
    lines: dict[Path_, int] = field(default_factory=dict)
    prefix: Path_ = ()

    def line_of(self, path: Path_) -> int | None:
        """Line of the longest known prefix of `path` (a missing key points at its parent)."""
        path = tuple(path)
        while True:
            if path in self.lines:
                return self.lines[path]
            if not path:
                return None
            path = path[:-1]

    def loc(self, path: Path_) -> Location:
        full = tuple(self.prefix) + tuple(path)
        return Location(self.file, self.line_of(tuple(path)), dotted(full) or None)


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def load_yaml(text: str, file: str) -> tuple[Any, Source]:
    src = Source(file)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, src
        data = _walk(loader, node, (), src, [])
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        raise SpecError([(Location(file, line), f"YAML syntax error: {what}")],
                        hint="fix the YAML syntax (indentation, quotes, colons) at that line") from None
    except yaml.YAMLError as exc:
        raise SpecError([(Location(file), f"YAML error: {exc}")]) from None
    finally:
        loader.dispose()
    return data, src


def _walk(loader: yaml.SafeLoader, node: yaml.Node, path: Path_, src: Source, problems: list) -> Any:
    src.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise SpecError([(Location(src.file, key_node.start_mark.line + 1, dotted(path) or None),
                                  "a mapping key must be a plain value")]) from None
            sub = path + (key,)
            if key in out:
                raise SpecError([(Location(src.file, key_node.start_mark.line + 1, dotted(sub)),
                                  f"duplicate key {key!r} (first at line {src.lines.get(sub)})")],
                                hint="remove one of them: YAML would silently keep only the last")
            src.lines[sub] = key_node.start_mark.line + 1
            out[key] = _walk(loader, value_node, sub, src, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(loader, item, path + (i,), src, problems) for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)
