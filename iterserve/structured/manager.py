"""Compiles structured-output constraints off the engine loop and caches them by spec.

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
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf

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
        """Builds the llguidance tokenizer on the compile thread now, so that a server's first
        constrained request does not wait for it."""
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
        ws = {"whitespace_flexible": self.config.any_whitespace}
        if not self.config.any_whitespace:
            ws.update(item_separator=", ", key_separator=": ")
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=ws)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _what(fmt: str) -> str:
    return {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list"}.get(fmt, "grammar")
