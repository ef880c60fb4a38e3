"""Strict JSON objects by default: an object schema that lists properties without stating
additionalProperties is compiled as `additionalProperties: false` (at any depth), and
--structured-outputs-allow-additional-properties keeps JSON Schema's permissive default. Checked on
the schema transform and on the compiled grammar (which texts it lets through); what the embedded
model writes under each is in test_server_openai_real.py and benchmarks/strict_json.py."""
from __future__ import annotations

import json

import pytest

from iterserve.config import EngineConfig
from iterserve.engine_args import add_engine_args
from iterserve.structured.manager import StructuredOutputConfig, StructuredOutputManager, strict_objects
from iterserve.structured.params import StructuredOutputsParams

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x"]}
NESTED = {"type": "object", "properties": {
    "name": {"type": "string"}, "where": POINT,
    "path": {"type": "array", "items": POINT},
    "either": {"anyOf": [POINT, {"type": "string"}]},
    "free": {"type": "object"},
    "open": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
    "ref": {"$ref": "#/$defs/p"}},
    "$defs": {"p": POINT}, "required": ["name"]}


def test_strict_objects_closes_every_object_that_lists_properties():
    out = strict_objects(NESTED)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["where"]["additionalProperties"] is False
    assert props["path"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # a free-form object stays free
    assert props["open"]["additionalProperties"] is True  # stated: kept as written
    assert NESTED["properties"]["where"] == POINT and "additionalProperties" not in POINT  # a copy
    # allOf members each name part of the keys: closing one would forbid the others'
    all_of = strict_objects({"allOf": [POINT, {"type": "object", "properties": {"z": POINT}}]})
    assert "additionalProperties" not in all_of["allOf"][0] and "additionalProperties" not in all_of["allOf"][1]
    assert all_of["allOf"][1]["properties"]["z"]["additionalProperties"] is False
    assert strict_objects({"type": "object", "properties": {}, "unevaluatedProperties": False}) == \
        {"type": "object", "properties": {}, "unevaluatedProperties": False}


def accepts(manager: StructuredOutputManager, tokenizer, schema: dict, text: str) -> bool:
    matcher = manager.compile(StructuredOutputsParams(json=schema)).result(timeout=60).deep_copy()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids)


@pytest.mark.parametrize("allow", [False, True], ids=["strict", "permissive"])
def test_grammar_follows_the_switch(tiny_loaded, allow):
    _, cfg, tok = tiny_loaded
    manager = StructuredOutputManager(tok, cfg.vocab_size, cfg.eos_token_ids,
                                      StructuredOutputConfig(allow_additional_properties=allow))
    assert accepts(manager, tok, NESTED, '{"name": "a", "where": {"x": 1}}')
    for extra in ('{"name": "a", "zz": 1}', '{"name": "a", "where": {"x": 1, "zz": 2}}',
                  '{"name": "a", "path": [{"x": 1, "zz": 2}]}'):
        assert accepts(manager, tok, NESTED, extra) is allow, extra
    assert accepts(manager, tok, NESTED, '{"name": "a", "free": {"anything": 1}}')  # free-form in both
    assert accepts(manager, tok, NESTED, '{"name": "a", "open": {"a": 1, "b": 2}}')  # stated true in both
    closed = NESTED | {"additionalProperties": False}
    assert not accepts(manager, tok, closed, '{"name": "a", "zz": 1}')  # stated false in both
    # json_object (any object) is never closed
    any_object = manager.compile(StructuredOutputsParams(json_object=True)).result(timeout=60).deep_copy()
    ids = tok.encode('{"a": 1, "b": {"c": 2}}', add_special_tokens=False)
    assert any_object.validate_tokens(ids) == len(ids)
    manager.shutdown()


def test_flag_reaches_the_engine_config():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).structured_outputs_allow_additional_properties is False
    args = p.parse_args(["--structured-outputs-allow-additional-properties"])
    assert args.structured_outputs_allow_additional_properties is True
    assert EngineConfig().structured_outputs_allow_additional_properties is False
    assert json.dumps(strict_objects(POINT))  # still JSON
