"""A structured output's schema as llguidance's grammar, checked without a tokenizer. Light on
purpose (llguidance's core only: no tokenizer library, no torch), so that a child process can
check a schema cheaply (gateway.schema_checks bounds each check's time and memory there).

The bounds before anything parses a schema: the text is at most `MAX_SCHEMA_CHARS` characters
and `MAX_SCHEMA_DEPTH` levels of JSON nesting, checked by one linear scan (a 1,000-level schema is
refused before Python's or the library's recursion meets it); it must parse as a JSON object.
llguidance's parser limits (`LIMITS`) then cap the lexer's and parser's work while building the
grammar and while computing each token's mask. They do not bound everything: deciding whether
an intersection of regexes (`allOf` of `pattern`s) is empty takes time exponential in their
number, which no limit of the library caps; hence the gateway's bounded check.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import llguidance

from loramux.engine.structured import StructuredOutput, StructuredOutputError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the type stubs only

MAX_SCHEMA_DEPTH = 64
"""Deepest JSON nesting of a schema's text (objects and arrays). OpenAI's strict mode allows 10
levels of schema nesting, each a few levels of JSON."""

READY = "ready\n"
"""The checking program's first line: started, its time bound may begin."""
MEMORY_ENV = "LORAMUX_SCHEMA_CHECK_MEMORY"
"""Address space (bytes) the checking program (`python -m loramux.engine.structured.schema`)
limits itself to."""

CHECKED = 256
"""Verdicts of `check_error` kept, by schema text."""

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
"""Compact JSON: no whitespace between tokens, so a model cannot pad its output forever."""

LIMITS = llguidance.LLParserLimits(verbose_errors=False)
"""llguidance's default limits (building a grammar's lexer: ~20 ms of fuel; one token's mask:
~15 ms of lexer fuel and ~2.5 ms of parser items; 500,000 grammar symbols), with error messages
that do not echo parser state. Text the grammar forces is outside the fuel: the engine bounds
it (engine.structured.grammar.MAX_FORCED_BYTES)."""


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec`, after the bounds in the module docstring."""
    if spec.json_schema is None:
        schema: dict[str, Any] = {"type": "object"}
    else:
        schema = _schema_object(spec.json_schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(f"the JSON schema cannot be compiled: {exc}") from None


def _schema_object(text: str) -> dict[str, Any]:
    depth = json_depth(text)
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(
            f"the JSON schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted"
        )
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(
            f"the JSON schema must be a JSON object, got {type(schema).__name__}"
        )
    return schema


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON `text`, brackets inside strings not
    counted; one pass, no recursion, whatever the text is."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def check_structured_output(spec: StructuredOutput) -> None:
    """Refuse, with StructuredOutputError, what can be refused without a tokenizer: a schema
    out of bounds, not JSON, or one the library cannot compile. The engine compiles (and probes
    the first mask) again at admission. Unbounded in time for some schemas (the module
    docstring): the gateway runs it through gateway.schema_checks."""
    error = check_error(spec)
    if error is not None:
        raise StructuredOutputError(error)


@functools.lru_cache(maxsize=CHECKED)
def check_error(spec: StructuredOutput) -> str | None:
    """Why `spec` cannot be served, or None; remembered by schema text."""
    try:
        grammar = grammar_text(spec)
    except StructuredOutputError as exc:
        return str(exc)
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, None, limits=LIMITS)
    except BaseException as exc:
        if not is_panic(exc):
            raise
        return PANIC_ERROR
    return f"the JSON schema cannot be compiled: {error}" if error else None


PANIC_ERROR = "the JSON schema cannot be compiled: the grammar library failed on it"


def is_panic(exc: BaseException) -> bool:
    """Whether `exc` is a Rust panic inside the library, which pyo3 raises as PanicException, a
    BaseException (so `except Exception` misses it)."""
    return type(exc).__name__ == "PanicException"


def serve_checks() -> None:
    """The checking program: for each line of stdin, a spec as JSON `[kind, json_schema]`, one
    line of stdout, its verdict as JSON (null: servable). Ends when stdin closes."""
    memory = int(os.environ.get(MEMORY_ENV, "0"))
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), daemon=True).start()
    sys.stdout.write(READY)
    sys.stdout.flush()
    for line in sys.stdin.buffer:
        try:
            kind, json_schema = json.loads(line)
            verdict = check_error(StructuredOutput(kind, json_schema))
        except StructuredOutputError as exc:  # refused by the spec's own bounds
            verdict = str(exc)
        sys.stdout.write(json.dumps(verdict) + "\n")
        sys.stdout.flush()


def _end_with_parent(parent: int) -> None:
    """Exit when the parent is gone, even in the middle of a check (the library releases the
    interpreter lock while it works, so this thread runs)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(0)


PARENT_POLL_SECONDS = 0.25


if __name__ == "__main__":
    serve_checks()
