"""What a JSON schema constraint may say: the keywords the grammar enforces, in their right types.

An output that finishes by its grammar must validate against its schema. xgrammar (0.2.9)
compiles some validation keywords to nothing, so outputs break them while finishing `stop`:
`uniqueItems`, `contains`, `not`, `if`/`then`/`else`, `dependentRequired`, `multipleOf` on
numbers, and `minLength`/`maxLength` beside a `pattern` or `format`; it takes a negative length
for no bound, and a remote `$ref` for any value. Such a schema is refused here, when the request
is made, with the keyword and where it is. A keyword JSON Schema does not know is ignored, as
validators ignore it; so is `format` alone (an annotation in JSON Schema 2020-12).

The walk is iterative (a 64 KB schema may nest deeper than Python's recursion) and visits only
schema positions: a property named `not` is a name, and `enum` or `default` values are data.
"""

from __future__ import annotations

from typing import Any

TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NOT_ENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
)
# where subschemas are: a schema, a list of schemas, a map of name -> schema
_ONE = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "propertyNames",
)
_MANY = ("anyOf", "allOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def schema_problem(schema: Any) -> str | None:
    """Why `schema` (parsed JSON) cannot be enforced as written, or None when it can."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"a schema must be an object or a boolean, at {where or 'the top level'}"
        problem = _node_problem(node)
        if problem is not None:
            return f"{problem}, at {where or 'the top level'}"
        stack.extend(_subschemas(where, node))
    return None


def _node_problem(node: dict[str, Any]) -> str | None:
    types = node.get("type", [])
    for name in types if isinstance(types, list) else [types]:
        if name not in TYPES:
            return f"type {name!r} is not one of {', '.join(TYPES)}"
    for key in _COUNTS:
        value = node.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{key} must be a non-negative integer, got {value!r}"
    for key in _NOT_ENFORCED:
        if key in node:
            return f'"{key}" is not enforced by the grammar (outputs could break it)'
    if node.get("uniqueItems") is True:
        return '"uniqueItems" is not enforced by the grammar (outputs could break it)'
    multiple = node.get("multipleOf")
    if multiple is not None and (types != "integer" or not isinstance(multiple, int)):
        return '"multipleOf" is enforced only on {"type": "integer"} with an integer value'
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return "minLength/maxLength beside a pattern or format are not enforced by the grammar"
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        return f"$ref {ref!r} is not a local reference (#/...)"
    return None


def _subschemas(where: str, node: dict[str, Any]) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    for key in _ONE:
        if key in node:
            value = node[key]
            if isinstance(value, list):  # items as a list: the draft-7 form of prefixItems
                found += [(f"{where}/{key}/{i}", v) for i, v in enumerate(value)]
            else:
                found.append((f"{where}/{key}", value))
    for key in _MANY:
        if isinstance(node.get(key), list):
            found += [(f"{where}/{key}/{i}", v) for i, v in enumerate(node[key])]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            found += [(f"{where}/{key}/{_escaped(n)}", v) for n, v in node[key].items()]
    return found


def _escaped(name: str) -> str:
    """A name as a JSON pointer writes it (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")
