"""Attention with RoPE: softmax attention, linear attention and its state, re-rotation (the subpackage is
``attn`` because the public function ``rotary.attention`` would hide a subpackage of that name)."""
