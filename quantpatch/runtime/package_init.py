"""quantpatch's runtime in this Megatron checkout: fake quantization of the GEMMs' operands
to low-precision number formats (MX, NVFP4, TransformerEngine's FP8 recipes, HiFP8, ParetoQ),
and a tensor saver. Installed by ``quantpatch init`` (and ``quantpatch saver install``) as
``megatron/core/quantpatch/``; ``quantpatch init --remove`` (``saver remove``) takes it out
again. Torch and the standard library only (Triton for the optional CUDA kernels).

The site code quantpatch inserts into ``megatron/core/tensor_parallel/layers.py`` and
``megatron/core/transformer/dot_product_attention.py`` reads each GEMM's format from a
``custom_quant_type`` variable and, where it is not ``'bf16'``, calls these entry points of
``quantpatch_ops``::

    from megatron.core.quantpatch import quantpatch_ops

    quantpatch_ops.quant_matmul(a, b, fmt, roles=("input", "weight"))         # forward
    quantpatch_ops.quant_matmul(g, w, fmt, roles=("grad_output", "weight"))   # input gradient
    quantpatch_ops.quant_matmul(g_t, x, fmt, roles=("grad_output", "input"))  # weight gradient
    quantpatch_ops.quant_baddbmm(buf, q, k_t, beta=0.0, alpha=scale, fmt=fmt) # Q.K^T
    quantpatch_ops.quant_bmm(p, v, fmt)                                       # P.V
    quantpatch_ops.flash_eligible(...) / flash_dot_product_attention(...)     # FA schemes
    quantpatch_ops.add_weight_scales(self, fmt, partition_dim=0)              # constructors
    quantpatch_ops.paretoq_linear(...) / paretoq_sharded_state_dict(...)      # ParetoQ

``roles`` names each operand of a product as TransformerEngine does (``input``, ``weight``,
``grad_output``): the format's entry says what each role is quantized to.
``fake_quant(x, fmt, role=...)`` quantizes one tensor and dequantizes it. The linear file
also calls ``quantpatch_layers.install(policy)`` (the layers a scheme keeps in BF16), and the
saver's marked calls (``# quantpatch: saver``) call ``tensor_saver``.

Modules (one concern each):

``quantpatch_ops.py``
    the entry points above: the dispatch, the quantized products, flash attention's route
``quantpatch_formats.py``
    the format spec: one entry per value (elements per operand role, block, scale rule,
    rounding, the reference it equals); every other module derives its tables from it
``quantpatch_env.py``
    every environment variable the runtime reads (``QUANTPATCH_*``), read once
``quantpatch_mx.py``
    the MX and HiFP8 arithmetic
``quantpatch_fp8.py``, ``quantpatch_delayed.py``
    TransformerEngine's current and blockwise FP8 scaling; its delayed scaling and the
    per-layer amax history
``quantpatch_nvfp4.py``
    NVFP4 and its stochastic rounding
``quantpatch_paretoq.py``
    ParetoQ's learnable weight steps
``quantpatch_rht.py``
    the random Hadamard transform of ``nvfp4-rht``
``quantpatch_quantize.py``
    which code quantizes a tensor: the Triton kernels or the PyTorch reference
``quantpatch_weights.py``
    weights quantized once per optimizer step, and the choice of GEMM
``quantpatch_layers.py``
    the BF16 layer policy (``quantpatch set --bf16-layers``)
``quantpatch_kernels.py``, ``quantpatch_fp8_kernels.py``, ``quantpatch_rht_kernels.py``
    the Triton kernels (bit-identical to the reference)
``quantpatch_gemm_kernels.py``
    the fused quantized GEMM: each operand tile quantized as the GEMM loads it
``quantpatch_flash.py``
    the flash-attention kernels of the FA schemes
``tensor_saver.py``
    the tensor saver's API (``quantpatch saver install``), also importable as
    ``megatron.core.tensor_saver``, the path a fork's own callers use
``quantpatch_saver/``
    the saver's parts: settings, capture, the writer threads, statistics, the file format,
    a fork's calling conventions, and the opt-in accelerators

Nothing is imported here: importing the package costs nothing until a site asks for a
module.
"""
