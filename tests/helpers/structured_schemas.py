"""JSON schemas for the structured-output tests: (name, schema), each one kind of constraint.

Strings carry maxLength, arrays maxItems and numbers bounds, and objects are closed
(``additionalProperties: false``, added by ``closed``), so that every output is short and a
small model finishes well inside the test's max_new_tokens (an open object lets SmolLM2 add
keys until the budget runs out).
"""

NAME = {"type": "string", "minLength": 1, "maxLength": 16}



def closed(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set it."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


SCHEMAS = [
    ("flat_required", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                       "required": ["name", "age"]}),
    ("enum_field", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("nested_objects", {"type": "object", "required": ["person"], "properties": {"person": {
        "type": "object", "required": ["name", "address"], "properties": {
            "name": NAME,
            "address": {"type": "object", "required": ["city", "zip"], "properties": {
                "city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}}),
    ("int_array_bounds", {"type": "object", "required": ["digits"], "properties": {"digits": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}}}),
    ("string_array", {"type": "object", "required": ["tags"], "properties": {"tags": {
        "type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 10}, "minItems": 1, "maxItems": 3}}}),
    ("number_bounds", {"type": "object", "required": ["celsius"], "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.25}}}),  # without multipleOf a
    # fraction may have any number of digits, and SmolLM2 sampled at 0.9 writes 0.2576745984335884867... to the end
    ("exclusive_bounds", {"type": "object", "required": ["level"], "properties": {
        "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}}),
    ("optional_field", {"type": "object", "required": ["title"], "properties": {
        "title": NAME, "subtitle": {"type": "string", "maxLength": 10}}, "additionalProperties": False}),
    ("boolean", {"type": "object", "required": ["done"], "properties": {"done": {"type": "boolean"}}}),
    ("date_pattern", {"type": "object", "required": ["date"], "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}}),
    ("phone_pattern", {"type": "object", "required": ["phone"], "properties": {
        "phone": {"type": "string", "pattern": "^\\+?[0-9]{3}-[0-9]{3}-[0-9]{4}$"}}}),
    ("const", {"type": "object", "required": ["version", "name"], "properties": {"version": {"const": 2}, "name": NAME}}),
    ("any_of", {"type": "object", "required": ["value"], "properties": {"value": {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 5}]}}}),
    ("array_of_objects", {"type": "object", "required": ["items"], "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "required": ["id", "kind"], "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99}, "kind": {"enum": ["book", "pen"]}}}}}}),
    ("nullable", {"type": "object", "required": ["first", "middle"], "properties": {
        "first": NAME, "middle": {"type": ["string", "null"], "maxLength": 8}}}),
    ("top_level_array", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 100}, "minItems": 3, "maxItems": 3}),
    ("top_level_enum", {"enum": ["yes", "no", "maybe"]}),
    ("multiple_of", {"type": "object", "required": ["minutes"], "properties": {
        "minutes": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}}}),
    ("format_date", {"type": "object", "required": ["born"], "properties": {"born": {"type": "string", "format": "date"}}}),
    ("deep_closed", {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": {
        "type": "object", "additionalProperties": False, "required": ["b"], "properties": {"b": {
            "type": "object", "additionalProperties": False, "required": ["c", "d"], "properties": {
                "c": {"type": "integer", "minimum": 0, "maximum": 5}, "d": {"type": "boolean"}}}}}}}),
    ("refs_defs", {"$defs": {"point": {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "type": "object", "required": ["start", "end"],
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}}),
    ("tuple_prefix_items", {"type": "array", "prefixItems": [NAME, {"type": "integer", "minimum": 0, "maximum": 10}, {"type": "boolean"}],
                            "items": False, "minItems": 3}),
    ("mixed_record", {"type": "object", "required": ["id", "status", "scores"], "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "status": {"enum": ["open", "closed"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "maxItems": 3},
        "note": {"type": ["string", "null"], "maxLength": 12}}}),
]

SCHEMAS = [(name, closed(schema)) for name, schema in SCHEMAS]

# a subset covering each kind once, for the default (not slow) run
DEFAULT = ["nested_objects", "int_array_bounds", "number_bounds", "optional_field", "phone_pattern", "any_of", "top_level_enum"]
