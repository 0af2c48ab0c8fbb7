"""A model's matmuls: weights packed once for oneDNN (linear), int8 W8A8 (int8_linear), the LM head (lm_head)."""
