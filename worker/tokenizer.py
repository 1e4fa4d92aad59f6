"""The model's tokenizer and chat template (transformers), as a PromptRenderer.

The worker renders prompts to token ids itself and hands the ids to the engine: the token
counts it trims by are then exactly the tokens the engine sees, and the engine does no
second tokenization.

Tokenizing is the costly part of a prompt (3 ms per 2,000 tokens with a 152k vocabulary,
against 0.03 ms for the template; it holds the GIL, on the event loop), and most of every
prompt is the same conversation as last turn's. A fast tokenizer splits out added tokens
(<|im_start|>, <|im_end|>, ...) before anything else and encodes the text between them
independently, so the text between added tokens is cached: a new turn encodes only its new
message and the last reply. Checked against whole-text encoding at start; a tokenizer for
which the two differ is encoded whole.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from loguru import logger

from .history import THINK_OPEN, ChatMessage

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
SEGMENT_CACHE_SIZE = 8192
_SELF_CHECK = [
    {"role": "system", "content": "You are terse.  Ünïcödé, 数字 123, emoji 🙂\n\n  spaces "},
    {"role": "user", "content": "<think>not really</think> hello\tworld\r\n"},
    {"role": "assistant", "content": " leading space, trailing newline\n"},
    {"role": "user", "content": "<|im_start|> inside text <|im_end|>?"},
]


class ChatTokenizer:
    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer  # heavy: imported only when a worker starts

        self._tokenizer: Any = AutoTokenizer.from_pretrained(model)
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {model} has no chat template")
        self.stop_token_ids = self._stop_token_ids(model)
        generation_prompt = self._tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
        )
        # QwQ-style templates open the think block in the prompt itself.
        self.opens_reasoning = str(generation_prompt).rstrip().endswith(THINK_OPEN)
        added = {str(k): int(v) for k, v in self._tokenizer.get_added_vocab().items()}
        self._added_ids = added
        pattern = "|".join(re.escape(token) for token in sorted(added, key=len, reverse=True))
        self._splitter = re.compile(f"({pattern})") if pattern else None
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_segments = self._splitter is not None and self._segmented_matches_whole()
        if not self._cache_segments:
            logger.info("Tokenizer of {}: encoding whole prompts (segment cache does not match it)", model)

    def _stop_token_ids(self, model: str) -> list[int]:
        """End-of-turn tokens: eos, the generation config's eos ids, and known end markers.

        Stop *tokens*, not stop strings: with skip_special_tokens a special-token stop
        string never appears in the text and would never match."""
        ids: set[int] = set()
        if self._tokenizer.eos_token_id is not None:
            ids.add(int(self._tokenizer.eos_token_id))
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(model).eos_token_id
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        except OSError:
            pass  # no generation_config.json
        vocab = self._tokenizer.get_vocab()
        ids.update(vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
        return sorted(ids)

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> list[int]:
        text = self._tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.encode(str(text))

    def encode(self, text: str) -> list[int]:
        if not self._cache_segments:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        return self._encode_segmented(text)

    def _encode_segmented(self, text: str) -> list[int]:
        assert self._splitter is not None
        ids: list[int] = []
        for index, part in enumerate(self._splitter.split(text)):
            if index % 2:  # an added token
                ids.append(self._added_ids[part])
            elif part:
                cached = self._segments.get(part)
                if cached is None:
                    cached = self._segments[part] = list(self._tokenizer.encode(part, add_special_tokens=False))
                    if len(self._segments) > SEGMENT_CACHE_SIZE:
                        self._segments.popitem(last=False)
                else:
                    self._segments.move_to_end(part)
                ids.extend(cached)
        return ids

    def _segmented_matches_whole(self) -> bool:
        for add_generation_prompt in (False, True):
            text = str(
                self._tokenizer.apply_chat_template(
                    _SELF_CHECK, add_generation_prompt=add_generation_prompt, tokenize=False
                )
            )
            whole = list(self._tokenizer.encode(text, add_special_tokens=False))
            if self._encode_segmented(text) != whole:
                return False
        self._segments.clear()
        return True

    def count_text(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))
