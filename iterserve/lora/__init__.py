"""LoRA adapters on one base model, batched together in every step (vLLM's multi-LoRA serving).

adapter.py reads and checks a PEFT adapter folder against the base model; manager.py keeps the
adapters the server knows (a bounded CPU cache of their weights, a bounded LRU of resident slots)
and says which slot each request's rows use; layers.py adds the adapters' deltas to the base
projections' outputs, grouped by slot, whatever kernel computed the base projection.
"""
