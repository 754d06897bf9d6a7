"""Tool arguments follow JSON's rules (session 30): ``2.0`` is an integer (JSON Schema) and reaches an
``integer``-typed tool parameter as the int ``2``; ``true`` is not the enum value ``1`` (Python's ``True == 1``)."""
from __future__ import annotations

from rlrepro.envs import Tool, check_arguments

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                           "mode": {"enum": [1, "a"]}, "flag": {"enum": [True]}}}


def test_integral_float_is_an_integer_and_reaches_the_tool_as_int():
    assert check_arguments(SCHEMA, {"n": 2.0}) is None
    assert check_arguments(SCHEMA, {"n": 2.5}) == "argument 'n' must be of type integer, got float"
    assert check_arguments(SCHEMA, {"n": True}) == "argument 'n' must be of type integer, got bool"
    seen = []
    tool = Tool("count", "counts", SCHEMA, fn=lambda **kw: seen.append(kw) or "ok")
    assert tool.run({"n": 3.0, "x": 2.0}).ok
    assert seen == [{"n": 3, "x": 2.0}]
    assert type(seen[0]["n"]) is int and type(seen[0]["x"]) is float  # a number stays as written
    assert tool.run({"n": 3}).ok and type(seen[1]["n"]) is int


def test_enum_compares_as_json():
    assert check_arguments(SCHEMA, {"mode": 1}) is None
    assert check_arguments(SCHEMA, {"mode": 1.0}) is None  # JSON: 1.0 is 1
    assert check_arguments(SCHEMA, {"mode": True}) == "argument 'mode' must be one of [1, 'a']"
    assert check_arguments(SCHEMA, {"flag": True}) is None
    assert check_arguments(SCHEMA, {"flag": 1}) == "argument 'flag' must be one of [True]"
