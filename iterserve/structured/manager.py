"""Compiles structured-output constraints off the engine loop and caches them by spec.

JSON schemas are strict about objects by default, as vLLM's xgrammar backend and OpenAI's strict
schemas are: an object schema that lists properties without stating additionalProperties is
compiled as if it said `false` (strict_objects), since llguidance otherwise follows JSON Schema's
permissive default and a small model fills the object with invented keys until max_tokens cuts the
JSON off. `StructuredOutputConfig.allow_additional_properties` (--structured-outputs-allow-additional-properties)
keeps the permissive default.

Why llguidance (not xgrammar): measured on the embedded model's 49152-token vocabulary
(docs/structured-outputs.md), it compiles a JSON schema in under a millisecond where xgrammar takes
milliseconds, fills 16 masks and applies them within a fraction of a millisecond, and its wheel
has no dependencies (xgrammar needs triton and a TVM runtime).

A compiled grammar is kept as a prototype matcher; each request gets a `deep_copy` of it, which
shares the compiled lexer and parser tables. Compilation runs on one worker thread: the engine
step never waits for it (a request whose grammar is not ready waits outside the scheduler), and a
constraint that fails to compile fails only its own request.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf

from iterserve.structured.bounded_numbers import bound_numbers_text
from iterserve.structured.grammar import RequestGrammar
from iterserve.structured.params import StructuredOutputError, StructuredOutputsParams

log = logging.getLogger("iterserve.structured")

# engines that share a tokenizer (tests, benchmarks) share its llguidance twin
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LL_TOKENIZERS_LOCK = threading.Lock()


@dataclass
class StructuredOutputConfig:
    cache_size: int = 256  # compiled grammars kept (least recently used dropped)
    max_errors_shown: int = 3  # compiler messages quoted in a 400
    # JSON schemas: any whitespace between tokens (True, vLLM's default) or one space after ':' and ','
    # (False): a small model under a flexible grammar can loop on newlines until max_tokens
    any_whitespace: bool = False
    # JSON schemas: an object schema with properties but no additionalProperties allows other keys
    # (True: JSON Schema's default) or not (False: vLLM's xgrammar default, OpenAI's strict mode)
    allow_additional_properties: bool = False
    # JSON schemas: integers and numbers without bounds get digit-bounding ones (bounded_numbers.py),
    # so that a small model cannot run a digit loop until max_tokens
    bound_numbers: bool = True


class StructuredOutputManager:
    """One per engine: the llguidance tokenizer, the grammar cache and the compile thread."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 config: StructuredOutputConfig | None = None) -> None:
        self.config = config or StructuredOutputConfig()
        self.vocab_size = vocab_size
        self._hf_tokenizer, self._eos_token_ids = hf_tokenizer, list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="iterserve-grammar")
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the prototype matcher; resolved at once when the spec is cached. Its
        exception, if any, is a StructuredOutputError. Safe from any thread."""
        key = params.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._executor.submit(self._compile, key)
            self._cache[key] = fut
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return fut

    def warm_up(self) -> concurrent.futures.Future:
        """Builds the llguidance tokenizer on the compile thread now. The server does not (its first
        constrained request builds it: a server that never sees a constraint should not hold it);
        benchmarks/structured_overhead.py does, so that its timings leave the one-off build out."""
        return self._executor.submit(lambda: self.ll_tokenizer)

    def new_grammar(self, prototype: llguidance.LLMatcher) -> RequestGrammar:
        return RequestGrammar(prototype.deep_copy())

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built at the first compilation (on the compile thread): it reads the whole vocabulary,
        about a second here, which an engine that never sees a constraint should not pay."""
        if self._ll_tokenizer is None:
            key = (self.vocab_size, tuple(self._eos_token_ids))
            with _LL_TOKENIZERS_LOCK:
                known = _LL_TOKENIZERS.setdefault(self._hf_tokenizer, {})
                if key not in known:
                    known[key] = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self._eos_token_ids or None)
                self._ll_tokenizer = known[key]
        return self._ll_tokenizer

    def _compile(self, key: tuple[str, str]) -> llguidance.LLMatcher:
        fmt, text = key
        tokenizer = self.ll_tokenizer
        try:
            grammar = self._grammar(fmt, text)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
            if failed:
                shown = "; ".join(m.strip() for m in messages[: self.config.max_errors_shown])
                raise StructuredOutputError(f"invalid or unsupported {_what(fmt)}: {shown}")
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        except StructuredOutputError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the compiler raises is this spec's fault
            raise StructuredOutputError(f"invalid {_what(fmt)}: {e}") from None
        if matcher.is_error():
            raise StructuredOutputError(f"cannot compile the {_what(fmt)}: {matcher.get_error()}")
        self.num_compiled += 1
        return matcher

    def _grammar(self, fmt: str, text: str) -> str:
        """llguidance's grammar for the spec. JSON schemas get the whitespace default as llguidance's
        `defaults`, so a schema's own "x-guidance" options still win."""
        if fmt != "json_schema":
            return llguidance.grammar_from(fmt, text)
        if not self.config.allow_additional_properties:
            text = strict_objects_text(text)
        if self.config.bound_numbers:
            text = bound_numbers_text(text)
        ws = {"whitespace_flexible": self.config.any_whitespace}
        if not self.config.any_whitespace:
            ws.update(item_separator=", ", key_separator=": ")
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=ws)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# where a JSON schema holds subschemas: keyword -> how (a map of them, a list of them, or one)
_SUBSCHEMAS = {"properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map",
               "dependentSchemas": "map", "items": "one_or_list", "prefixItems": "list", "anyOf": "list",
               "oneOf": "list", "additionalProperties": "one", "additionalItems": "one", "contains": "one",
               "if": "one", "then": "one", "else": "one", "propertyNames": "one"}


def strict_objects(schema, strict: bool = True):
    """A copy of a JSON schema in which every object schema that lists `properties` and states
    neither `additionalProperties` nor `unevaluatedProperties` gets `additionalProperties: false`,
    at any depth. Left as written: objects without `properties` (a free-form object, json_object's
    `{"type": "object"}`), and the members of `allOf` (each names only part of the keys, so closing
    one would forbid the others'; their nested objects are closed), and `not`."""
    if isinstance(schema, list):
        return [strict_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        how = _SUBSCHEMAS.get(key)
        if how == "map" and isinstance(value, dict):
            value = {k: strict_objects(v) for k, v in value.items()}
        elif how in ("list", "one_or_list") and isinstance(value, list):
            value = [strict_objects(v) for v in value]
        elif how in ("one", "one_or_list") and isinstance(value, dict):
            value = strict_objects(value)
        elif key == "allOf" and isinstance(value, list):
            value = [strict_objects(v, strict=False) for v in value]
        out[key] = value
    if (strict and isinstance(out.get("properties"), dict) and "additionalProperties" not in out
            and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def strict_objects_text(text: str) -> str:
    """strict_objects on a schema's JSON text; text that is not JSON is left for the compiler's error."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(strict_objects(schema))


def _what(fmt: str) -> str:
    return {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list"}.get(fmt, "grammar")
