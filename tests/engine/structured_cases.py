"""The structured-output suite: 30 JSON schemas and 10 regexes, each with a prompt that asks for it, for the engine,
API and cluster tests. Strings, arrays and numbers are bounded where a small model sampled at temperature 1 could
otherwise run past max_tokens (an output cut by max_tokens ends with finish_reason "length", not a grammar
failure)."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 16}

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "boolean": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -9,
                                                                                 "maximum": 9}},
              "required": ["kind", "x"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000,
                                                                 "multipleOf": 0.01}},
                      "required": ["price"], "additionalProperties": False},
    "exclusive_bounds": {"type": "object", "properties": {"p": {"type": "integer", "exclusiveMinimum": 0,
                                                                "exclusiveMaximum": 10}},
                         "required": ["p"], "additionalProperties": False},
    "array_of_ints": {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer",
                                                                                             "minimum": 0,
                                                                                             "maximum": 99},
                                                                  "minItems": 1, "maxItems": 5}},
                      "required": ["values"], "additionalProperties": False},
    "array_of_strings": {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT, "maxItems": 4}},
                         "required": ["tags"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2,
                        "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": NAME, "address": {
            "type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {"title": NAME, "subtitle": SHORT}, "required": ["title"],
                        "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 20}},
                 "required": ["note"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                                                 {"type": "string", "pattern": "^id-[a-z]{3}$"}]}},
               "required": ["id"], "additionalProperties": False},
    "one_of_objects": {"oneOf": [
        {"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["circle"], "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["square"], "additionalProperties": False}]},
    "ref": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "definitions_ref": {"type": "object", "definitions": {"tag": SHORT},
                        "properties": {"a": {"$ref": "#/definitions/tag"}}, "required": ["a"],
                        "additionalProperties": False},
    "date": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"],
             "additionalProperties": False},
    "time": {"type": "object", "properties": {"at": {"type": "string", "format": "time", "maxLength": 20}},
             "required": ["at"], "additionalProperties": False},
    "email": {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
              "required": ["email"], "additionalProperties": False},
    "uuid": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"],
             "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "string_lengths": {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 8}},
                       "required": ["word"], "additionalProperties": False},
    "multiple_types": {"type": "object", "properties": {"v": {"type": ["integer", "boolean"], "minimum": 0,
                                                              "maximum": 9}},
                       "required": ["v"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]},
                                                             "maxItems": 3}},
                   "required": ["days"], "additionalProperties": False},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "object", "properties": {"d": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["d"], "additionalProperties": False}}, "required": ["c"], "additionalProperties": False}},
        "required": ["b"], "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                          "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}],
               "properties": {"a": {}, "b": {}}, "additionalProperties": False},
    "many_fields": {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9}
                                                     for k in ("a", "b", "c", "d", "e", "f")},
                    "required": ["a", "b", "c", "d", "e", "f"], "additionalProperties": False},
    "tool_arguments": {"type": "object", "properties": {"location": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["location", "unit"], "additionalProperties": False},
    "ref_in_array": {"type": "object", "$defs": {"leaf": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["v"], "additionalProperties": False}},
        "properties": {"leaves": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/leaf"}}},
        "required": ["leaves"], "additionalProperties": False},
}

# Compiled (and their outputs valid when they end), but not in the sampled suite: nothing bounds their length
# (a recursive $ref nests as deep as the sampler goes; a date-time's fractional seconds take any number of digits).
UNBOUNDED: dict[str, dict] = {
    "recursive": {"type": "object", "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"], "additionalProperties": False}},
        "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"], "additionalProperties": False},
    "date_time": {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}},
                  "required": ["at"], "additionalProperties": False},
}

REGEXES: dict[str, str] = {
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "yes_no": r"(yes|no)",
    "word_list": r"[a-z]{2,8}(, [a-z]{2,8}){0,3}",
    "hex_color": r"#[0-9a-fA-F]{6}",
    "time": r"([01]\d|2[0-3]):[0-5]\d",
    "version": r"v\d{1,2}\.\d{1,2}\.\d{1,2}",
    "sentence": r"[A-Z][a-z]{1,10}( [a-z]{1,10}){1,5}\.",
    "money": r"\$\d{1,4}\.\d{2}",
}


def prompt_for_schema(name: str) -> str:
    return f"Answer with one JSON value for the case '{name}'. Be brief."


def prompt_for_regex(name: str) -> str:
    return f"Write one {name.replace('_', ' ')}."
