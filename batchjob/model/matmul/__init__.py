"""A model's matmuls: weights packed once for oneDNN (linear), W8A8 (int8_linear), GGUF blocks (gguf_linear),
weight-only int8/int4 quantized into those blocks at load (weight_only), the LM head (lm_head)."""
