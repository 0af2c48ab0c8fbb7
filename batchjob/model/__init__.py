"""The model layer: Llama-family weights (GGUF, HF folders), tokenizer and chat template, the forward pass in torch
ops, and the attention metadata that the engine and the Triton kernels share. Imports nothing above it."""
