"""Quantized weights: formats (quantize / dequantize references), QuantLinear, checkpoint detection."""
