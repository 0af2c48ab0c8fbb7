"""Vision-language models: the vision tower and connector in torch, the language model on the decoder of llama.py.
One family so far, Idefics3 (SmolVLM)."""
