"""One observer per attention entry point; each is called by its wrapper for eager calls.

* :mod:`.mha`: ``MultiheadAttention.forward``, its fast path
  (``torch._native_multi_head_attention``) and its fallback
  (``F.multi_head_attention_forward``, also when a custom module calls it).
* :mod:`.layer`: the fused encoder layer (``torch._transformer_encoder_layer_fwd``).
* :mod:`.sdpa`: ``F.scaled_dot_product_attention``.
"""
