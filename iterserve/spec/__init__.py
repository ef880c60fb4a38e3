"""Speculative decoding: proposers of draft tokens (prompt lookup, suffix index, a draft model),
the per-request choice of how many to draft, and the exact acceptance rule (spec/verify.py)."""
