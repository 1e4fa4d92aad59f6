"""The model's tokenizer and chat template (transformers), as a PromptRenderer.

The worker renders prompts to token ids itself and hands the ids to the engine: the token
counts it trims by are then exactly the tokens the engine sees, and the engine does no
second tokenization.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .history import THINK_OPEN, ChatMessage

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


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
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def count_text(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False))
