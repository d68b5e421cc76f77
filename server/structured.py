"""Structured output for the protocols: response formats (JSON schema / any JSON object) and forced
tool calls become llguidance grammars that the engine enforces token by token.

A forced tool call is written in the format the chat template teaches (json: Hermes/Qwen3, xml:
Qwen3-Coder/3.5), so the same tool-call parser reads it back; its arguments follow the tool's
parameter schema: as one JSON object (json format) or parameter by parameter (xml format: the
required ones, typed values, enums)."""
from __future__ import annotations

import json

from infernix_jax.engine.constraints import GrammarError, check_grammar, grammar_from_json_schema, json_rule

from .errors import invalid
from .parsing import param_schemas

ANY_OBJECT = {"type": "object"}


def response_format_grammar(fmt, param: str) -> str | None:
    """OpenAI Chat response_format / Responses text.format -> grammar (None for plain text)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid(f"'{param}' must be an object", param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return grammar_from_json_schema(ANY_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)       # Chat nests it; Responses puts schema at the top
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            return grammar_from_json_schema(ANY_OBJECT)
        if not isinstance(schema, dict):
            raise invalid(f"'{param}': the json_schema needs a 'schema' object", param)
        return _compile(lambda: grammar_from_json_schema(schema), param)
    raise invalid(f"'{param}': unknown type {kind!r}; expected text, json_object or json_schema", param)


def tool_call_grammar(tools: list[dict], forced: str, fmt: str | None, param: str = "tool_choice") -> str:
    """A grammar for exactly one call of the named tool, or of any tool when forced == "required"."""
    chosen = [t["function"] for t in tools if forced == "required" or t["function"]["name"] == forced]
    if fmt == "xml":
        alts = " | ".join(f"f{i}" for i in range(len(chosen)))
        rules = [f'start: "<tool_call>\\n" ({alts}) "</tool_call>"', "TEXT: /[^<]*/"]
        for i, fn in enumerate(chosen):
            rules += _xml_function(f"f{i}", fn)
        grammar = "\n".join(rules)
    else:
        options = [{"type": "object", "properties": {"name": {"const": fn["name"]},
                                                     "arguments": _object_schema(fn.get("parameters"))},
                    "required": ["name", "arguments"], "additionalProperties": False} for fn in chosen]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        grammar = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {json_rule(schema)}'
    return grammar


def _xml_function(rule: str, fn: dict) -> list[str]:
    """Rules for one <function=NAME> block: the required parameters in the schema's order, then each
    optional one at most once; every value typed by its schema (what parsing.typed_value reads back).
    A root anyOf/oneOf offers the parameters of all its branches, none required."""
    schema = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    props, required = param_schemas(schema), list(schema.get("required") or [])
    order = [p for p in required if p in props] + [p for p in props if p not in required]
    parts, rules = [], []
    for j, name in enumerate(order):
        rules.append(f'{rule}_p{j}: "<parameter=" {_lit(name)} ">\\n" {rule}_v{j} "\\n</parameter>\\n"')
        rules.append(f"{rule}_v{j}: {_xml_value(props[name])}")
        parts.append(f"{rule}_p{j}" + ("" if name in required else "?"))
    rules.insert(0, f'{rule}: "<function=" {_lit(fn["name"])} ">\\n" {" ".join(parts)} "</function>\\n"')
    return rules


def _xml_value(schema) -> str:
    """A rule body for one parameter's text: strings are raw text, other types their JSON form."""
    if not isinstance(schema, dict):
        return "TEXT"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return " | ".join(_lit(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"])
    t = schema.get("type")
    if t == "string" or (t is None and not any(k in schema for k in ("anyOf", "oneOf", "properties", "items"))):
        n = schema.get("maxLength")
        return f"/[^<]{{0,{int(n)}}}/" if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else "TEXT"
    if t == "boolean":
        return '"true" | "false"'
    return json_rule(schema)        # numbers, objects, arrays, unions: their JSON text


def _object_schema(schema) -> dict:
    if not isinstance(schema, dict) or not schema:
        return ANY_OBJECT
    return {k: v for k, v in schema.items() if k != "$schema"}


def _lit(s: str) -> str:
    return json.dumps(s)          # a JSON string is a valid Lark string literal


def _compile(make, param: str) -> str:
    try:
        return make()
    except (GrammarError, ValueError, TypeError) as e:
        raise invalid(f"'{param}': the schema cannot be used for constrained decoding: {e}", param) from None


def validated(engine, grammar: str | None, param: str) -> str | None:
    """Compile the grammar once here so that a bad schema is a 400, not an engine error."""
    if grammar is None:
        return None
    try:
        check_grammar(engine.tokenizer, engine.cfg.vocab_size, engine.eos_ids, grammar)
    except GrammarError as e:
        raise invalid(f"'{param}': {e}", param) from None
    return grammar
