"""Speculative decoding's drafting side: proposers of draft tokens (prompt lookup, suffix index, a
draft model) and the per-request choice of how many to draft (controller.py).

The rule of the package: it proposes, the runner verifies. It imports the runner (a draft model is
run by a ModelRunner of its own) and the configs, never the other way round: the acceptance rule
the runner applies to drafts is `iterserve/rejection_sampler.py`, and `--speculative-config` is
`config.SpeculativeConfig`, beside the other configs.
"""
