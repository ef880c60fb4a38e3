"""Inputs shared by the test suite and the equality checks that run outside it
(`iterserve.bench.gpu_equality`), kept in the package so that neither imports the other's folder.

The chats cover what a chat template must handle: one user turn, a system prompt, and a multi-turn
history with an assistant reply.
"""
from __future__ import annotations

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "user", "content": "Explain photosynthesis in two sentences."}],
    [{"role": "user", "content": "List three prime numbers greater than 50."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [{"role": "user", "content": "What is 17 times 23?"}],
    [{"role": "system", "content": "You are a pirate. Answer like one."},
     {"role": "user", "content": "Describe your ship."}],
    [{"role": "user", "content": "Who wrote Pride and Prejudice?"},
     {"role": "assistant", "content": "Jane Austen wrote Pride and Prejudice."},
     {"role": "user", "content": "Name another novel by her."}],
    [{"role": "user", "content": "Give me one tip for writing clean Python code."}],
]

# tests/test_batch_invariant.py and benchmarks/batch_invariance.py: 12 prose prompts whose greedy
# texts are compared alone, in a step of 16 (with the 4 fillers) and under KV pressure
BATCH_INVARIANCE_PROMPTS = [
    "The history of the printing press begins in",
    "Here is a recipe for a simple tomato soup:",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
    "The three largest cities in Europe are",
    "Once upon a time, in a village by the sea,",
    "To change a flat tyre on a bicycle, first",
    "The main causes of the French Revolution were",
    "A haiku about autumn leaves:",
    "In machine learning, overfitting means",
    "The best way to learn a new language is",
    "Water boils at a lower temperature on a mountain because",
]
BATCH_INVARIANCE_FILLERS = ["Tell me about the moon.", "List five prime numbers:", "Why is the sky blue?", "SELECT * FROM"]
