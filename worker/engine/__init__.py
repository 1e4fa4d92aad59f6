"""The inference engine.

- ``port.py``: the Engine contract the core uses, and its request/update/stats types
- ``vllm.py``: the vLLM adapter (the only module that imports vLLM)
- ``tokenizer.py``: the model's chat template and tokenizer (transformers), the core's
  PromptRenderer
"""
