"""Shapes of the tiny test models that several modules build, so that they share one model and one compiled stage
per build option (tests/conftest.py's `tiny` fixture keys both by these arguments)."""

# Every linear a whole number of 256-weight K-quant blocks: the quantized and batched builds' shape.
KQUANT_DIMS = dict(num_layers=3, head_dim=64, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2)
