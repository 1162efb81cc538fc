"""JSON for the agent through CPython's own C scanner and encoder (the `_json` module), without
the json package: `import json` loads re, and re loads enum and sre's parser and compiler, ~3 ms
of CPU on every start of a supervisor or of `agent.py` on every host (python3 -S itself starts
in ~9 ms). Same text as json.dumps (ASCII, NaN and Infinity allowed, keys as given), the same
values as json.loads, errors as ValueError (a bad document) or TypeError (a value JSON has no
form for).

The C functions are CPython's, private but unchanged from 3.8 to 3.13 (json.encoder and
json.decoder call them the same way); where they are missing (another Python) or do not answer
as this expects (checked once, at import), json itself does the work.
"""

from __future__ import annotations

TYPE_CHECKING = False   # as layout's (which imports this module): typing is not imported at run time
if TYPE_CHECKING:
    from typing import Any, Callable

_WS = " \t\n\r"   # what JSON allows around a value (json.decoder.WHITESPACE)
_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


class _Context:
    """What the C scanner reads, once, from json.decoder.JSONDecoder: its defaults."""
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


def _no_json_form(o: Any) -> Any:
    raise TypeError("Object of type %s is not JSON serializable" % type(o).__name__)


def _c_functions() -> tuple[Callable[[Any, tuple[str, str]], str], Callable[[str], Any]] | None:
    try:
        from _json import encode_basestring_ascii as esc  # type: ignore[import-not-found,unused-ignore]  # CPython's C module: no stub
        from _json import make_encoder, make_scanner  # type: ignore[import-not-found,unused-ignore]  # CPython's C module: no stub
        scan = make_scanner(_Context())   # type: ignore[arg-type]  # it reads the attributes json's decoder has
    except (ImportError, TypeError, AttributeError):
        return None

    def dumps(obj: Any, separators: tuple[str, str]) -> str:
        if isinstance(obj, str):
            return esc(obj)
        # a new encoder each time, as json.dumps makes one: its markers (circular references)
        # are left behind by a value that failed
        enc = make_encoder({}, _no_json_form, esc, None, separators[1], separators[0], False, False, True)
        return "".join(enc(obj, 0))

    def loads(s: str) -> Any:
        i = len(s) - len(s.lstrip(_WS))
        try:
            obj, end = scan(s, i)
        except StopIteration as exc:
            raise ValueError("Expecting value: char %s" % exc.value) from None
        if len(s.rstrip(_WS)) != end:   # a value never ends in whitespace: what is past it is not
            raise ValueError("Extra data: char %d" % end)
        return obj

    try:
        inner = {"b": False}
        probe = {"a": [1, -2.5, "\u00e9\n", None, True, inner], "": float("inf")}
        text = '{"a":[1,-2.5,"\\u00e9\\n",null,true,{"b":false}],"":Infinity}'
        if dumps(probe, (",", ":")) != text or dumps(inner, (", ", ": ")) != '{"b": false}':
            return None
        if loads(" %s\n" % text) != probe:
            return None
    except Exception:   # noqa: BLE001  anything at all: json then
        return None
    return dumps, loads


_C = _c_functions()   # (dumps, loads) through the C functions; None: json does the work
_c_dumps, _c_loads = _C if _C is not None else (None, None)


def dumps(obj: Any, separators: tuple[str, str] | None = None) -> str:
    """json.dumps(obj, separators=separators), its other options at their defaults."""
    if _c_dumps is None:
        import json   # lazy: only where CPython's C functions are not (see the module's text)
        return json.dumps(obj, separators=separators)
    return _c_dumps(obj, separators or (", ", ": "))


def loads(s: str | bytes | bytearray) -> Any:
    """json.loads(s) (bytes: UTF-8 only)."""
    if not isinstance(s, str):
        s = bytes(s).decode("utf-8")
    if _c_loads is None:
        import json   # lazy: as in dumps
        return json.loads(s)
    return _c_loads(s)
