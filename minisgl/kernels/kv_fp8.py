"""The FP8 KV cache's quantization inside Triton kernels: e4m3 bits of value / scale, as
`minisgl.kernels.fp8.quantize_kv` defines them, rounded on the float32 bits rather than cast, so the
kernels give torch's bytes on every device and under Triton's interpreter. docs/quantization.md.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the kernels that use this need Triton anyway
    triton = None

if triton is not None:

    @triton.jit
    def e4m3_bits(x, scale):
        """The float8_e4m3fn bytes (uint8) of x / scale: float32 division (correctly rounded), clamped
        to [-448, 448], rounded to the nearest e4m3 value, ties to even; NaN stays NaN (0x7F)."""
        y = tl.math.div_rn(x.to(tl.float32), scale)
        nan = y != y
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        bits = y.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # normal results (|y| >= 2^-6, bits 0x3C800000): the 23-bit mantissa rounded to 3 bits, ties to
        # even (a carry moves into the exponent); e4m3's exponent bias is 7, float32's 127: 120 << 3
        rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
        normal = (rounded >> 20) - 960
        # subnormal results: multiples of 2^-9, where float32 addition of 2^14 rounds (ties to even);
        # code = |y| / 2^-9, and 8 (2^-6 reached) is the smallest normal's code
        a = tl.abs(y)
        sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.uint32)
        code = tl.where(mag >= 0x3C800000, normal, sub)
        code = tl.where(nan, 0x7F, code | sign)
        return code.to(tl.uint8)
