"""The FP8 KV cache's quantization inside Triton kernels: e4m3 bits of value / scale.

The KV-store and the fused q/k-norm + RoPE + KV-store kernels call `e4m3_bits` to write an FP8 page
(`minisgl.kernels.fp8.quantize_kv` is the definition: value / scale in float32, clamped to [-448, 448],
rounded to the nearest e4m3 value, ties to even). The rounding is written out on the float32 bits
instead of casting to `tl.float8e4nv`, so that the kernels give torch's bytes on every device and under
Triton's interpreter (whose float8 cast truncates and mishandles subnormals, so the CPU tests could not
check the cast itself). It costs a dozen integer operations per value, in kernels bound by memory.

A kernel receives the layer's two scales as a pointer to two float32 values (K's, then V's: a row of
`MHAKVCachePool.scales`), read on the device: nothing is synchronised with the host.
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
