"""exp and 2**x as vector arithmetic for the CPU kernels, for arguments <= 0: LLVM lowers TVM's
``exp`` of a vector to one libm call per lane (no vector math library on the ``llvm`` target).
Both take 2**n, n = round(x), from the exponent bits and multiply it by a polynomial in the
remainder; below 2**-126 they return 0."""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

# Taylor coefficients of 2**f = exp(f ln 2) for |f| <= 1/2: relative error ~1e-7, one float32 ulp.
_EXP2_TAYLOR = tuple(math.log(2) ** k / math.factorial(k) for k in range(7))
# Cephes' expf: ln 2 in two parts (the first exact in few bits, so n * it is exact for the n
# here), and the polynomial of (e**r - 1 - r) / r**2 for |r| <= ln(2) / 2: ~1 float32 ulp.
_LN2_HIGH, _LN2_LOW = 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)  # fmt: skip


def _pow2(n: tirx.PrimExpr) -> tirx.PrimExpr:
    """2**n for an integral float n in [-127, 0] (0 for -127)."""
    return T.reinterpret("float32", T.shift_left(T.cast(n, "int32") + 127, 23))


def _horner(coefficients: tuple[float, ...], x: tirx.PrimExpr) -> tirx.PrimExpr:
    """The polynomial with these coefficients, highest degree first."""
    poly = T.float32(coefficients[0])
    for c in coefficients[1:]:
        poly = poly * x + T.float32(c)
    return poly


def exp2(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """2**x for x <= 0."""
    x = T.max(x, T.float32(-127))
    n = T.floor(x + T.float32(0.5))
    return _horner(_EXP2_TAYLOR[::-1], x - n) * _pow2(n)


def exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """e**x for x <= 0, as accurate as libm's expf to about an ulp: x = n ln 2 + r."""
    x = T.max(x, T.float32(-88))
    n = T.floor(x * T.float32(math.log2(math.e)) + T.float32(0.5))
    r = x - n * T.float32(_LN2_HIGH) - n * T.float32(_LN2_LOW)
    return (_horner(_EXP_POLY, r) * r * r + r + T.float32(1)) * _pow2(n)
