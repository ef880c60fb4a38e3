"""Inputs shared by the test suite and the equality checks that run outside it
(benchmarks/gpu_equality.py), kept in the package, which both import.

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

# tests/test_server_openai_real.py and benchmarks/strict_json.py: held-out object schemas that do not
# state additionalProperties (none was used to choose the strict default), each with its prompt. Under
# JSON Schema's permissive default the embedded model invents keys until max_tokens cuts the JSON off;
# strict (the default) gives exactly these keys
_STR = {"type": "string", "maxLength": 24}
STRICT_JSON_CASES = [
    ("Describe a person as JSON.",
     {"type": "object", "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["name", "age"]}),
    ("Give a book as JSON.",
     {"type": "object", "properties": {"title": _STR, "author": _STR, "year": {"type": "integer"}},
      "required": ["title", "author"]}),
    ("Report the weather in Paris as JSON.",
     {"type": "object", "properties": {"city": _STR, "temperature": {"type": "number"},
                                       "sky": {"enum": ["clear", "cloudy", "rain"]}}, "required": ["city", "sky"]}),
    ("A product in a shop, as JSON.",
     {"type": "object", "properties": {"product": _STR, "price": {"type": "number", "minimum": 0},
                                       "in_stock": {"type": "boolean"}}, "required": ["product", "price"]}),
    ("Write an address as JSON.",
     {"type": "object", "properties": {"street": _STR, "city": _STR,
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
      "required": ["street", "city"]}),
    ("An event in a calendar, as JSON.",
     {"type": "object", "properties": {"event": _STR, "day": {"type": "integer", "minimum": 1, "maximum": 31},
                                       "place": _STR}, "required": ["event", "day"]}),
    ("Summarise a recipe as JSON.",
     {"type": "object", "properties": {"dish": _STR, "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                                       "ingredients": {"type": "array", "items": _STR, "maxItems": 4}},
      "required": ["dish", "ingredients"]}),
    ("Name a film and its director as JSON.",
     {"type": "object", "properties": {"film": _STR, "director": _STR}, "required": ["film"]}),
    ("Describe a car as JSON.",
     {"type": "object", "properties": {"make": _STR, "model": _STR, "electric": {"type": "boolean"}},
      "required": ["make", "model", "electric"]}),
    ("A city and its country, as JSON.",
     {"type": "object", "properties": {"city": _STR, "country": _STR,
                                       "location": {"type": "object", "properties": {"lat": {"type": "number"},
                                                                                     "lon": {"type": "number"}},
                                                    "required": ["lat", "lon"]}},
      "required": ["city", "country", "location"]}),
    ("A student's grades as JSON.",
     {"type": "object", "properties": {"student": _STR, "grade": {"enum": ["A", "B", "C", "D"]},
                                       "passed": {"type": "boolean"}}, "required": ["student", "grade"]}),
    ("A song as JSON.",
     {"type": "object", "properties": {"song": _STR, "artist": _STR, "seconds": {"type": "integer", "minimum": 1}},
      "required": ["song", "artist"]}),
]


def schema_keys_only(value, schema: dict) -> bool:
    """Whether a JSON value has no object keys besides its schema's, at any depth of object schemas."""
    if schema.get("type") == "object" and isinstance(value, dict):
        props = schema.get("properties", {})
        return set(value) <= set(props) and all(schema_keys_only(value[k], props[k]) for k in value)
    if schema.get("type") == "array" and isinstance(value, list) and isinstance(schema.get("items"), dict):
        return all(schema_keys_only(v, schema["items"]) for v in value)
    return True
