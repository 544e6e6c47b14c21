"""A grammar constraint checked against the model's tokenizer, before the engine compiles it.

vLLM checks a grammar without the tokenizer when the request is added; llguidance, compiling it
in the engine, then finds what only the tokenizer can tell (a special token or token id the model
does not have) and fails quietly: the engine logs a warning and the request ends at once with
an empty output and finish reason "stop". Checking with the tokenizer here turns that into an
error naming the field. Only for llguidance, the backend the worker runs (args.py).
"""

from __future__ import annotations

from typing import Any

from ...errors import RequestRejected
from ...schemas import ErrorCode, GrammarOutput, StructuredOutput


class GrammarCheck:
    def __init__(self, tokenizer: Any, vocab_size: int | None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size or 0
        self._ll: Any = None
        self._unusable = False

    def check(self, structured: StructuredOutput | None) -> None:
        """Raises RequestRejected for a grammar this tokenizer cannot run (blocking: call it in a
        thread; the first call builds llguidance's view of the vocabulary)."""
        if not isinstance(structured, GrammarOutput):
            return
        ll = self._ll_tokenizer()
        if ll is None:
            return
        import llguidance
        from vllm.v1.structured_output.backend_guidance import serialize_guidance_grammar
        from vllm.v1.structured_output.backend_types import StructuredOutputOptions

        try:
            grammar = serialize_guidance_grammar(StructuredOutputOptions.GRAMMAR, structured.grammar)
        except (ValueError, KeyError, TypeError):
            return  # vLLM's own check refuses it, with this message
        error = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if error:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                f"the grammar does not fit this model's tokenizer: {error.strip()}",
                field="$.structured.grammar",
            )

    def _ll_tokenizer(self) -> Any:
        if self._ll is None and not self._unusable:
            try:
                import llguidance.hf

                tok = self._tokenizer
                self._ll = getattr(tok, "llg_tokenizer", None) or llguidance.hf.from_tokenizer(
                    tok, max(self._vocab_size, len(tok))
                )
            except Exception:  # a tokenizer llguidance cannot read: vLLM refuses its requests itself
                self._unusable = True
        return self._ll
