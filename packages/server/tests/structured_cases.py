"""Structured-output inputs shared by the offline and HTTP tests: schemas, regexes, choices.

Every string has a ``maxLength`` and every array a ``maxItems``: a random-weight model picks
uniformly among the tokens a grammar allows, and an unbounded string would rarely close.
"""

import re

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150}}},
    {
        "type": "object",
        "properties": {"flag": {"type": "boolean"}, "note": {"type": "null"}},
        "required": ["flag", "note"],
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "nick": NAME},
        "required": ["id"],
    },
    {
        "$defs": {"person": {"type": "object", "properties": {"name": NAME}, "required": ["name"]}},
        "type": "object",
        "properties": {"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}},
        "required": ["author"],
    },
    {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]},
    {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]
            }
        },
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                    },
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {
        "type": "object",
        "properties": {
            "level1": {
                "type": "object",
                "properties": {
                    "level2": {
                        "type": "object",
                        "properties": {"leaf": {"type": "boolean"}},
                        "required": ["leaf"],
                    }
                },
                "required": ["level2"],
            }
        },
        "required": ["level1"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 1},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,8}$"},
            "ok": {"type": "boolean"},
        },
        "required": ["code", "ok"],
    },
    {
        "type": "object",
        "properties": {
            "first": NAME,
            "last": NAME,
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        },
        "required": ["first", "email"],
    },
    {
        "$defs": {
            "range": {
                "type": "object",
                "properties": {
                    "lo": {"type": "integer", "minimum": 0, "maximum": 50},
                    "hi": {"type": "integer", "minimum": 50, "maximum": 100},
                },
                "required": ["lo", "hi"],
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/range"},
        "minItems": 1,
        "maxItems": 3,
    },
]

REGEXES = {
    "date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z0-9._]{1,10}@[a-z]{1,10}\.(com|org|net)",
    "identifier": r"[A-Za-z_][A-Za-z0-9_]{0,15}",
}

CHOICES = [["positive", "negative", "neutral"], ["yes", "no"], ["日本", "Köln", 'a "quoted" one']]


def matches_regex(name: str, text: str) -> bool:
    return re.fullmatch(REGEXES[name], text) is not None
