"""The shape an answer must take: a Spark type and the JSON schema that constrains decoding to
it, each made from the other.

``responseSchema`` may be a Spark ``StructType`` (or its JSON, or a DDL string such as
``"answer string, score int"``), or a JSON schema (a dict or its JSON). A Spark type becomes a
JSON object whose every field is required, nullable fields accepting ``null``; a JSON schema is
typed for Spark as far as its types say (an ``integer`` is a ``bigint``, a ``number`` a
``double``, an object with ``properties`` a struct in their order, one without a map) and any
part whose type cannot be told (``anyOf`` of different types) is kept as its JSON text.

Example::

    shape = ResponseSchema.of(StructType([StructField("answer", StringType(), False)]))
    shape.json_schema   # '{"type": "object", "properties": {"answer": {"type": "string"}}, ...}'
    shape.spark_type    # the StructType's JSON, for from_json
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

#: Spark integer types and the values they hold (a JSON integer outside them would not parse);
#: a bigint's at most 18 digits: llguidance cannot bound a range at 2**63 (it fails to build)
_INTEGER_BOUNDS = {"byte": 2 ** 7, "short": 2 ** 15, "integer": 2 ** 31, "long": 10 ** 18}
_FORMATS = {"date": "date", "timestamp": "date-time", "timestamp_ntz": "date-time"}


@dataclass(frozen=True)
class ResponseSchema:
    """``json_schema``: the JSON schema (text) decoding follows; ``spark_type``: the Spark type
    (its JSON) each answer is parsed into."""

    json_schema: str
    spark_type: str

    @staticmethod
    def of(value: Any, parse_ddl: Optional[Callable[[str], Any]] = None) -> "ResponseSchema":
        """From a Spark ``DataType``, a JSON schema dict, or the text of either (a DDL string
        needs ``parse_ddl``, a session's parser). ``ValueError`` names what cannot be
        followed."""
        from pyspark.sql.types import DataType, StructType, _parse_datatype_json_string

        if isinstance(value, str):
            text = value.strip()
            try:
                value = json.loads(text)
            except ValueError:
                if parse_ddl is None:
                    raise ValueError("responseSchema as DDL text needs a Spark session; give a "
                                     "StructType or a JSON schema instead") from None
                value = parse_ddl(text)
            else:
                if isinstance(value, dict) and value.get("type") == "struct":
                    value = _parse_datatype_json_string(text)
        if isinstance(value, DataType):
            if not isinstance(value, StructType):
                raise ValueError(f"responseSchema must be a struct (an answer is a JSON object), "
                                 f"got {value.simpleString()}")
            return ResponseSchema(json.dumps(_json_schema(value, "responseSchema")),
                                  value.json())
        if isinstance(value, dict):
            spark = _spark_type(value, "responseSchema")
            if not isinstance(spark, StructType):
                raise ValueError(f"responseSchema's JSON schema must describe an object, got "
                                 f"{json.dumps(value)[:200]}")
            return ResponseSchema(json.dumps(value), spark.json())
        raise ValueError(f"responseSchema must be a StructType, a JSON schema (a dict) or the "
                         f"text of either, got {type(value).__name__}")


def as_text(value: Any) -> str:
    """What the param holds: a ``DataType``'s JSON, a dict's JSON, or the text as it is."""
    if hasattr(value, "json") and callable(value.json):
        return str(value.json())
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str):
        return value
    raise TypeError(f"responseSchema must be a StructType, a JSON schema (a dict) or the text "
                    f"of either, got {type(value).__name__}")


def _json_schema(kind: Any, where: str) -> Dict[str, Any]:
    """The JSON schema of a Spark type (``where`` names the field in errors)."""
    from pyspark.sql.types import ArrayType, MapType, StringType, StructType

    if isinstance(kind, StructType):
        properties = {}
        for field in kind.fields:
            schema = _json_schema(field.dataType, f"{where}.{field.name}")
            properties[field.name] = {"anyOf": [schema, {"type": "null"}]} \
                if field.nullable else schema
        return {"type": "object", "properties": properties,
                "required": [field.name for field in kind.fields],
                "additionalProperties": False}
    if isinstance(kind, ArrayType):
        return {"type": "array", "items": _json_schema(kind.elementType, f"{where}[]")}
    if isinstance(kind, MapType):
        if not isinstance(kind.keyType, StringType):
            raise ValueError(f"{where}: a map's keys must be strings to be JSON, got "
                             f"{kind.keyType.simpleString()}")
        return {"type": "object",
                "additionalProperties": _json_schema(kind.valueType, f"{where}{{}}")}
    name = kind.typeName()
    if name in _INTEGER_BOUNDS:
        bound = _INTEGER_BOUNDS[name]
        low = -bound if name != "long" else 1 - bound
        return {"type": "integer", "minimum": low, "maximum": bound - 1}
    if name in ("float", "double") or name.startswith("decimal"):
        return {"type": "number"}
    if name in ("string", "varchar", "char"):
        return {"type": "string"}
    if name == "boolean":
        return {"type": "boolean"}
    if name in _FORMATS:
        return {"type": "string", "format": _FORMATS[name]}
    raise ValueError(f"{where}: {kind.simpleString()} has no JSON form an answer can take; "
                     f"use strings, numbers, booleans, dates, timestamps, arrays, maps with "
                     f"string keys and structs")


def _spark_type(schema: Any, where: str) -> Any:
    """The Spark type a value of JSON ``schema`` parses into (a string holding its JSON where
    the schema does not tell one type)."""
    from pyspark.sql import types as T

    if not isinstance(schema, dict):
        return T.StringType()
    options = schema.get("anyOf") or schema.get("oneOf") or []
    kept = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
    if len(kept) == 1:  # a value or null: its value's type (Spark columns are nullable)
        return _spark_type(kept[0], where)
    kinds = _kinds(schema)
    if kinds == ["object"] or "properties" in schema:
        properties = schema.get("properties") or {}
        if properties:
            return T.StructType([T.StructField(name, _spark_type(sub, f"{where}.{name}"))
                                 for name, sub in properties.items()])
        values = schema.get("additionalProperties")
        return T.MapType(T.StringType(), _spark_type(values if isinstance(values, dict)
                                                     else {}, f"{where}{{}}"))
    if kinds == ["array"]:
        return T.ArrayType(_spark_type(schema.get("items", {}), f"{where}[]"))
    simple = {"string": T.StringType(), "integer": T.LongType(), "number": T.DoubleType(),
              "boolean": T.BooleanType()}
    if len(kinds) == 1 and kinds[0] in simple:
        return simple[kinds[0]]
    return T.StringType()


def _kinds(schema: Dict[str, Any]) -> List[str]:
    """The non-null JSON types a schema allows, as far as ``type``, ``enum``, ``const``,
    ``anyOf`` and ``oneOf`` tell (``[]`` where they do not)."""
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return sorted({k for k in kinds if k != "null"})
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        names = {bool: "boolean", int: "integer", float: "number", str: "string"}
        return sorted({names.get(type(v), "?") for v in values if v is not None})
    options = schema.get("anyOf") or schema.get("oneOf") or []
    found = {k for option in options if isinstance(option, dict) for k in _kinds(option)}
    return sorted(found)
