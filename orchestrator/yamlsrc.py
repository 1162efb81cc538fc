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


MAX_BYTES = 4 << 20      # a cluster file or inventory: far larger than any real one
MAX_VALUES = 200_000     # values after aliases are expanded (a "billion laughs" stops here)


def load_yaml(text: str, file: str) -> tuple[Any, Source]:
    src = Source(file)
    if len(text) > MAX_BYTES:
        raise SpecError([(Location(file), f"the file is {len(text) >> 20} MB; orch reads at most "
                                          f"{MAX_BYTES >> 20} MB")], hint="is this the right file?")
    if "\0" in text:
        raise SpecError([(Location(file, text.count("\n", 0, text.index("\0")) + 1),
                          "a NUL byte: this is not a text file (or it was damaged)")])
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # checks every character at once (ReaderError)
        node = loader.get_single_node()
        if node is None:
            return None, src
        data = _walk(loader, node, (), src, [0])
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = " ".join(x for x in (exc.context, exc.problem) if x)
        lines = text.splitlines()
        bad = lines[line - 1] if line is not None and 0 < line <= len(lines) else ""
        if "\t" in bad[:len(bad) - len(bad.lstrip())] or "'\\t'" in (exc.problem or ""):
            hint = "YAML indents with spaces, never tabs: replace the tab(s) at that line with spaces"
        else:
            hint = "fix the YAML syntax (indentation, quotes, colons) at that line"
        raise SpecError([(Location(file, line), f"YAML syntax error: {what}")], hint=hint) from None
    except RecursionError:
        raise SpecError([(Location(file), "the YAML nests too deep, or an alias contains itself (&a [*a])")],
                        hint="write the values out") from None
    except yaml.YAMLError as exc:  # ReaderError (a character YAML refuses) and kin
        pos = getattr(exc, "position", None)
        line = text.count("\n", 0, pos) + 1 if isinstance(pos, int) else None
        why = getattr(exc, "reason", None) or str(exc).splitlines()[0]
        raise SpecError([(Location(file, line), f"YAML error: {why}")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, src


def _walk(loader: yaml.SafeLoader, node: yaml.Node, path: Path_, src: Source, count: list) -> Any:
    count[0] += 1
    if count[0] > MAX_VALUES:
        raise SpecError([(Location(src.file, node.start_mark.line + 1, dotted(path) or None),
                          f"the file expands to more than {MAX_VALUES} values (aliases repeating aliases?)")],
                        hint="write the values out, or use fewer nested aliases (*name)")
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
            out[key] = _walk(loader, value_node, sub, src, count)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(loader, item, path + (i,), src, count) for i, item in enumerate(node.value)]
    value = loader.construct_object(node, deep=True)
    if isinstance(value, str) and "\0" in value:
        raise SpecError([(Location(src.file, node.start_mark.line + 1, dotted(path) or None),
                          "a NUL character (\\0) in a value: no host, file or command can hold one")])
    return value
