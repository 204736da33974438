"""MLX affine quantization for tfjax: the formats and their plain products live beside the kernels that read them
(`pallas_kernels.quant`); this module is their name inside the package."""

from __future__ import annotations

from pallas_kernels.quant import (  # noqa: F401
    BITS,
    GROUP_SIZES,
    dequantize,
    dequantize_kernel_layout,
    dequantize_pair_layout,
    from_kernel_layout,
    from_pair_layout,
    kernel_tile,
    pack,
    pack_scale_bias,
    pair_tile,
    qmatmul_reference,
    quantize,
    to_kernel_layout,
    to_pair_layout,
    unpack,
    unpack_scale_bias,
)
