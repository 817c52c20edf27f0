"""YAML text to Python objects for schedules: libyaml's events, our own iterative builder.

PyYAML's constructor spends a Python call chain per node (a megabyte of block YAML took over a
second); this builder walks libyaml's event stream once with an explicit stack and gives the same
objects ``yaml.load(text, Loader=yaml.SafeLoader)`` gives for what a schedule can hold:

- plain scalars resolve as PyYAML's YAML 1.1 resolver resolves them (each distinct plain scalar is
  resolved once, by PyYAML itself unless it is a plain decimal integer or an ordinary word);
  quoted scalars are strings; the explicit tags ``!!map !!seq !!str !!int !!float !!bool !!null``
  are honoured and every other tag is refused;
- an alias is the very object of its anchor (shared, never expanded), and an anchor used inside its
  own node gives a self-containing object, as PyYAML builds it;
- duplicate keys, merge keys (``<<``), unhashable keys, duplicate anchors and a second document are
  refused. Nesting is bounded by libyaml (1000 levels); the builder itself never recurses.

Every refusal is a ``yaml.YAMLError`` carrying the position in the text.
"""
from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.events import (AliasEvent, DocumentStartEvent, MappingEndEvent, MappingStartEvent, ScalarEvent,
                         SequenceEndEvent, SequenceStartEvent, StreamEndEvent)

from ..errors import brief

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TAG = "tag:yaml.org,2002:"
_MERGE = _TAG + "merge"
_STR = _TAG + "str"
_MERGE_REFUSED = "merge keys (<<) are not accepted"
#: Words YAML 1.1 (as PyYAML reads it) makes booleans or null.
_SPECIAL_WORDS = frozenset("yes Yes YES no No NO true True TRUE false False FALSE on On ON off Off OFF null Null NULL "
                           "y Y n N".split())
_EXPLICIT_SCALAR_TAGS = frozenset(_TAG + name for name in ("str", "int", "float", "bool", "null"))
#: Tags a plain scalar may resolve to (PyYAML's implicit resolvers, less merge and value).
_IMPLICIT_SCALAR_TAGS = _EXPLICIT_SCALAR_TAGS | {_TAG + "timestamp"}
_ACCEPTED = "!!map, !!seq, !!str, !!int, !!float, !!bool and !!null"
_MISSING = object()
_LIST = object()


def load_yaml(text: str) -> Any:
    """The one YAML document of ``text`` as Python objects (``None`` for an empty stream)."""
    loader = _Loader(text)
    try:
        return _Builder(loader).document()
    finally:
        loader.dispose()


class _Builder:
    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.plain: dict[str, Any] = {}  # each distinct plain scalar, resolved once
        self.anchors: dict[str, tuple[Any, Any]] = {}  # anchor -> (object, mark)

    def document(self) -> Any:
        get = self.loader.get_event
        get()  # StreamStartEvent
        start = get()
        if start.__class__ is StreamEndEvent:
            return None
        root = self._node(get)
        get()  # DocumentEndEvent
        after = get()
        if after.__class__ is DocumentStartEvent:
            raise ComposerError("expected a single document in the stream", start.start_mark,
                                "but found another document", after.start_mark)
        return root

    def _node(self, get: Any) -> Any:
        """Build the node whose first event comes next; iterative (the stack holds the open containers)."""
        plain, scalar = self.plain, self._scalar
        stack: list[Any] = []  # open containers
        keys: list[Any] = []  # per open container: the pending key of a mapping (_MISSING when none), _LIST for a list
        while True:
            event = get()
            cls = event.__class__
            is_key = bool(stack) and keys[-1] is _MISSING
            if cls is ScalarEvent:
                value = _MISSING
                if event.tag is None and event.implicit[0] and event.anchor is None:
                    value = plain.get(event.value, _MISSING)
                if value is _MISSING:
                    value = scalar(event, is_key)
                opened = False
            elif cls is MappingStartEvent or cls is SequenceStartEvent:
                value = self._container(event, cls is MappingStartEvent)
                opened = True
            elif cls is AliasEvent:
                found = self.anchors.get(event.anchor)
                if found is None:
                    raise ComposerError(None, None, f"found undefined alias {event.anchor!r}", event.start_mark)
                value, opened = found[0], False
            elif cls is MappingEndEvent or cls is SequenceEndEvent:
                done = stack.pop()
                keys.pop()
                if not stack:
                    return done
                continue
            else:
                raise ComposerError(None, None, f"unexpected {cls.__name__}", event.start_mark)
            if not stack:
                if not opened:
                    return value
            else:
                key = keys[-1]
                if key is _LIST:
                    stack[-1].append(value)
                elif key is _MISSING:
                    self._check_key(stack[-1], value, event)
                    keys[-1] = value
                else:
                    stack[-1][key] = value
                    keys[-1] = _MISSING
            if opened:
                stack.append(value)
                keys.append(_MISSING if cls is MappingStartEvent else _LIST)

    def _register(self, event: Any, value: Any) -> None:
        anchor = event.anchor
        if anchor is None:
            return
        if anchor in self.anchors:
            raise ComposerError(f"found duplicate anchor {anchor!r}; first occurrence", self.anchors[anchor][1],
                                "second occurrence", event.start_mark)
        self.anchors[anchor] = (value, event.start_mark)

    def _container(self, event: Any, is_map: bool) -> Any:
        tag = event.tag
        if tag not in (None, "!"):
            wanted = _TAG + ("map" if is_map else "seq")
            if tag != wanted:
                raise ConstructorError(None, None, _refused_tag(tag), event.start_mark)
        value: Any = {} if is_map else []
        self._register(event, value)
        return value

    def _scalar(self, event: Any, is_key: bool) -> Any:
        tag, text = event.tag, event.value
        if tag is None or tag == "!":
            if not event.implicit[0]:
                value: Any = text
            else:
                value = self._resolve_plain(text, event, is_key)
                self.plain[text] = value
        elif tag == _MERGE and is_key:
            raise ConstructorError(None, None, _MERGE_REFUSED, event.start_mark)
        elif tag in _EXPLICIT_SCALAR_TAGS:
            try:
                value = SafeConstructor.yaml_constructors[tag](self.loader, yaml.ScalarNode(tag, text))
            except (ValueError, KeyError, OverflowError) as err:
                raise ConstructorError(None, None, f"cannot read {brief(text)} as !!{tag[len(_TAG):]}",
                                       event.start_mark) from err
        else:
            raise ConstructorError(None, None, _refused_tag(tag), event.start_mark)
        self._register(event, value)
        return value

    def _resolve_plain(self, text: str, event: Any, is_key: bool) -> Any:
        if text.isascii():
            digits = text[1:] if text[:1] == "-" else text
            if digits.isdigit() and (digits == "0" or digits[0] != "0"):
                return int(text)
            if text.isidentifier() and text not in _SPECIAL_WORDS:
                return text
        tag = self.loader.resolve(yaml.ScalarNode, text, (True, False))
        if tag == _STR:
            return text
        if tag == _MERGE and is_key:
            raise ConstructorError(None, None, _MERGE_REFUSED, event.start_mark)
        if tag not in _IMPLICIT_SCALAR_TAGS:
            raise ConstructorError(None, None, f"could not determine a constructor for the tag {tag!r}",
                                   event.start_mark)
        return SafeConstructor.yaml_constructors[tag](self.loader, yaml.ScalarNode(tag, text))

    @staticmethod
    def _check_key(mapping: dict, key: Any, event: Any) -> None:
        try:
            duplicate = key in mapping
        except TypeError:
            raise ConstructorError(None, None, f"unhashable key {brief(key)}", event.start_mark) from None
        if duplicate:
            raise ConstructorError(None, None, f"duplicate key {brief(key)}", event.start_mark)


def _refused_tag(tag: str) -> str:
    shown = "!!" + tag[len(_TAG):] if tag.startswith(_TAG) else tag
    return f"the YAML tag {shown!r} is not accepted in a schedule (only {_ACCEPTED})"


def yaml_message(err: BaseException) -> str:
    """A YAML error as one line with 1-based line and column, without PyYAML's ``in "<unicode string>"``.

    ``while parsing a flow sequence (line 1, column 4): expected ',' or ']', but got ':' (line 2, column 2)``.
    """
    if not isinstance(err, yaml.MarkedYAMLError):
        return " ".join(str(err).split())

    def at(mark: Any) -> str:
        return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""

    parts = []
    if err.context:
        parts.append(f"{err.context}{at(err.context_mark)}")
    if err.problem:
        parts.append(f"{err.problem}{at(err.problem_mark)}")
    return " ".join(": ".join(parts).split()) or " ".join(str(err).split())
