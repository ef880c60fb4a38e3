"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) compiled with llguidance,
cached by spec, and applied to each step's logits as a per-request token bitmask."""
