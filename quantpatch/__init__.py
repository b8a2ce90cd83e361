"""quantpatch: switch, record and instrument the quantization formats of a Megatron-LM checkout."""

__version__ = "0.1.0"
