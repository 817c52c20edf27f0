"""Our YAML builder against PyYAML's pure-Python safe loader, on many generated documents.

Each seed writes one YAML document (block or flow style, nested maps and lists, scalars of every
form YAML 1.1 resolves, quoted and tagged forms, anchors and aliases, self-referencing anchors);
``load_yaml`` must give what ``yaml.load(text, Loader=yaml.SafeLoader)`` gives: the same types and
values, in the same order, with the same objects shared (an alias is its anchor's object).
"""
from __future__ import annotations

import math
import random

import pytest
import yaml

from rlx_gpu.schedule.yaml_reader import load_yaml

PLAIN = ["0", "-0", "12", "-12", "+12", "012", "0o17", "0x1F", "0xFF_FF", "0b101", "1_000", "1__0", "1:20",
         "190:20:30", "-1:30", "1.5", "-1.5", ".5", "5.", "0.", "-.5", "1e5", "1.0e+5", "6.8523015e+5",
         "685.230_15e+03", "1_2.3_4", "1e", ".inf", "-.Inf", "+.INF", ".nan", ".NaN", "yes", "No", "on", "OFF",
         "y", "n", "Y", "true", "False", "TRUE", "null", "Null", "NULL", "~", "f32", "lstm", "rlx-thunks/1", "_x",
         "x1", "2001-12-14", "2001-12-14t21:59:43.10-05:00", "2001-12-14 21:59:43.10", "1.5.6", "0x", "--1",
         "é", "²", "12abc", "abc def", "99999999999999999999999", "-9_9", "0_0", "=x", "<x"]
KEYS = ["op", "dst", "n", "1", "-2", "0x10", "1.5", "true", "no", "null", "2001-12-14", "k y", "é", "012", "+1"]
TAGGED = ["!!int 12", "!!int '0x1F'", "!!int '-1_000'", "!!str 12", "!!str yes", "!!float 1", "!!float '.inf'",
          "!!bool yes", "!!bool 'false'", "!!null ''", "!!null x", "! 12", "! true", "!!str"]


class _Writer:
    """One random YAML document; plain scalars drawn from PLAIN, keys unique by resolved value."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.anchors: list[str] = []

    def scalar(self, flow: bool) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.15 and self.anchors:
            return "*" + rng.choice(self.anchors)
        if roll < 0.25:
            return rng.choice(TAGGED if not flow else TAGGED[:-3])  # libyaml ends a bare tag at ',', PyYAML not
        text = rng.choice(PLAIN)
        if roll < 0.35:
            return "'" + text + "'"
        if roll < 0.42:
            return '"' + text + '"'
        if roll < 0.5:
            return self.anchor() + " " + text
        return text

    def anchor(self) -> str:
        name = f"a{len(self.anchors)}"
        self.anchors.append(name)
        return "&" + name

    def props(self, kind: str) -> str:
        parts = []
        if self.rng.random() < 0.25:
            parts.append(self.anchor())  # registered before the children: they may alias it (a cycle)
        if self.rng.random() < 0.15:
            parts.append("!!" + kind)
        return " ".join(parts)

    def keys(self) -> list[str]:
        count = self.rng.randrange(0, 5)
        chosen, seen = [], []
        for text in self.rng.sample(KEYS, len(KEYS)):
            value = yaml.safe_load(f"k: {text}")["k"]
            if len(chosen) < count and value not in seen:
                chosen.append(text)
                seen.append(value)
        return chosen

    def flow(self, depth: int) -> str:
        kind = self.rng.choice(["seq", "map", "scalar"] if depth < 4 else ["scalar"])
        if kind == "scalar":
            return self.scalar(flow=True)
        props = self.props(kind)
        if kind == "seq":
            body = "[" + ", ".join(self.flow(depth + 1) for _ in range(self.rng.randrange(0, 4))) + "]"
        else:
            body = "{" + ", ".join(f"{key}: {self.flow(depth + 1)}" for key in self.keys()) + "}"
        return (props + " " + body).strip()

    def block(self, depth: int, indent: int) -> tuple[str, list[str]]:
        """(what follows 'key:' or '-' on its line, the lines below it)."""
        roll = self.rng.random()
        if depth >= 4 or roll < 0.4:
            return " " + self.scalar(flow=False), []
        if roll < 0.55:
            return " " + self.flow(depth), []
        kind = "seq" if roll < 0.78 else "map"
        props = self.props(kind)
        lines = self.block_lines(kind, depth, indent)
        if not lines:
            return (" " + props + " " + ("[]" if kind == "seq" else "{}")).rstrip(), []
        return (" " + props).rstrip(), lines

    def block_lines(self, kind: str, depth: int, indent: int) -> list[str]:
        pad, lines = " " * indent, []
        heads = ["-"] * self.rng.randrange(0, 4) if kind == "seq" else [f"{key}:" for key in self.keys()]
        for head in heads:
            rest, below = self.block(depth + 1, indent + 2)
            lines.append(pad + head + rest)
            lines += below
        return lines

    def document(self) -> str:
        if self.rng.random() < 0.3:
            return self.flow(0) + "\n"
        lines = self.block_lines(self.rng.choice(["seq", "map"]), 0, 0)
        return "\n".join(lines) + "\n" if lines else "[]\n"


def _shape(obj, seen=None) -> object:
    """A comparable form of obj: containers numbered in visiting order, a revisit as ('ref', number)."""
    seen = {} if seen is None else seen
    if isinstance(obj, (list, dict)):
        if id(obj) in seen:
            return ("ref", seen[id(obj)])
        seen[id(obj)] = len(seen)
        if isinstance(obj, list):
            return ("list", [_shape(item, seen) for item in obj])
        return ("dict", [(_shape(key, seen), _shape(value, seen)) for key, value in obj.items()])
    if isinstance(obj, float) and math.isnan(obj):
        return ("float", "nan")
    return (type(obj).__name__, repr(obj))


@pytest.mark.parametrize("chunk", range(8))
def test_generated_documents_load_as_pyyaml_loads_them(chunk):
    checked = 0
    for seed in range(chunk * 250, (chunk + 1) * 250):
        text = _Writer(seed).document()
        try:
            expected = yaml.load(text, Loader=yaml.SafeLoader)  # noqa: S506 (the safe loader)
        except yaml.YAMLError:
            with pytest.raises((yaml.YAMLError, ValueError)):
                load_yaml(text)
            continue
        assert _shape(load_yaml(text)) == _shape(expected), f"seed {seed}:\n{text}"
        checked += 1
    assert checked > 150  # most generated documents are valid YAML


def test_an_alias_is_its_anchors_object_and_a_self_reference_is_a_cycle():
    data = load_yaml("a: &x {k: [1, 2]}\nb: *x\nc: &l [1, *l]\nd: &s text\ne: *s\n")
    assert data["a"] is data["b"]
    assert data["c"][1] is data["c"]
    assert data["d"] is data["e"]
    block = load_yaml("- &t\n  op: fill\n  n: 4\n- *t\n- *t\n")
    assert block[0] is block[1] is block[2] and block[0] == {"op": "fill", "n": 4}


@pytest.mark.parametrize("text,message", [
    ("a: 1\nb: 2\na: 3\n", r"duplicate key 'a'"),
    ("1: x\n0x1: y\n", r"duplicate key 1"),
    ("base: &b {n: 1}\nm:\n  <<: *b\n", r"merge keys \(<<\) are not accepted"),
    ("m: {!!merge x: 1}\n", r"merge keys"),
    ("v: <<\n", r"could not determine a constructor for the tag 'tag:yaml.org,2002:merge'"),
    ("v: =\n", r"tag 'tag:yaml.org,2002:value'"),
    ("? [1]\n: 2\n", r"unhashable key \[\]"),
    ("a: &x 1\nb: &x 2\n", r"found duplicate anchor 'x'"),
    ("a: *nowhere\n", r"found undefined alias 'nowhere'"),
    ("a: 1\n---\nb: 2\n", r"expected a single document"),
    ("v: !!binary aGk=\n", r"the YAML tag '!!binary' is not accepted"),
    ("v: !!set {a}\n", r"the YAML tag '!!set' is not accepted"),
    ("v: !!timestamp 2001-12-14\n", r"the YAML tag '!!timestamp' is not accepted"),
    ("v: !custom 1\n", r"the YAML tag '!custom' is not accepted"),
    ("v: !!map [1]\n", r"the YAML tag '!!map' is not accepted"),
    ("v: !!bool maybe\n", r"cannot read 'maybe' as !!bool"),
    ("v: !!int x\n", r"cannot read 'x' as !!int"),
])
def test_what_a_schedule_cannot_hold_is_refused(text, message):
    with pytest.raises(yaml.YAMLError, match=message):
        load_yaml(text)


def test_empty_text_and_nesting():
    assert load_yaml("") is None and load_yaml("# only a comment\n") is None
    deep = "[" * 900 + "]" * 900
    value = load_yaml(deep)
    for _ in range(899):
        value = value[0]
    assert value == []
    with pytest.raises(yaml.YAMLError, match="maximum nesting depth"):
        load_yaml("[" * 2000 + "]" * 2000)
