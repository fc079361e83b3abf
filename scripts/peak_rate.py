"""This CPU's peak multiply-add rate, measured: the compute floor's rate in ``bench_cpu``.

The clock that lscpu gives (its max MHz, or the TSC rate) is not the clock the vector units run
at: on the 2-core AVX-512 Xeon these benchmarks ran on (2026-11-28), lscpu gives 2.6 GHz while
each core sustained 7.5 G ``vpdpbusd`` a second (2 a cycle at 3.7 GHz), so a floor from lscpu's
clock was 1.42x too slow. This probe compiles a loop of 12 independent chains of the
instruction the kernels use (``cc -O2``, the loop in assembly so that the compiler neither
merges nor spills the chains), runs one copy per thread at once, and counts instructions a
second.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_PROGRAM = r"""
#include <stdio.h>
#include <time.h>
#define R(j) "%%" REG #j
#define STEP(j) OP " %%" REG "1, %%" REG "0, " R(j) "\n\t"
int main(void) {
  const long n = 100000000;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < n; i++)
    __asm__ volatile(STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7) STEP(8) STEP(9) STEP(10)
                     STEP(11) STEP(12) STEP(13) ::: "xmm2", "xmm3", "xmm4", "xmm5", "xmm6",
                     "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13");
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("%.6e\n", 12.0 * n / ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec)));
  return 0;
}
"""


@dataclass(frozen=True)
class Instruction:
    """One multiply-add instruction as the probe runs it (AT&T mnemonic and register prefix:
    12 independent chains of it, registers 2-13, from registers 0 and 1), and the multiply-adds
    it does."""

    op: str
    register: str
    multiply_adds: int

    @property
    def name(self) -> str:
        return f"{self.op} ({self.register}mm)"


VPDPBUSD_512 = Instruction("vpdpbusd", "z", 64)
# Without VNNI the kernels multiply with vpmaddubsw (u8 x s8 pairs summed in int16) and widen
# with vpmaddwd now and then: its rate alone bounds theirs.
VPMADDUBSW_512 = Instruction("vpmaddubsw", "z", 64)
VPMADDUBSW_256 = Instruction("vpmaddubsw", "y", 32)
FMA_512 = Instruction("vfmadd231ps", "z", 16)
FMA_256 = Instruction("vfmadd231ps", "y", 8)


def int8_instruction(instruction: str, lanes: int) -> Instruction | None:
    """The probe of the int8 kernels' integer dot product (``IntegerDot.instruction`` on
    ``lanes`` int32 lanes, as ``compiler/int8_matmul.py: integer_dot`` picks it); None for
    AVX-VNNI on 256 bits, whose mnemonic the assembler takes only with a {vex} prefix."""
    probes = {
        ("vpdpbusd", 16): VPDPBUSD_512,
        ("vpmaddubsw", 16): VPMADDUBSW_512,
        ("vpmaddubsw", 8): VPMADDUBSW_256,
    }
    return probes.get((instruction, lanes))


def measured_rate(instruction: Instruction, threads: int) -> float | None:
    """Multiply-adds a second of ``threads`` cores each running ``instruction`` flat out; None
    where no C compiler builds the probe or this CPU lacks the instruction."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "probe.c", Path(tmp) / "probe"
        defines = f'#define OP "{instruction.op}"\n#define REG "{instruction.register}mm"\n'
        source.write_text(defines + _PROGRAM)
        built = subprocess.run(
            [compiler, "-O2", str(source), "-o", str(binary)],
            capture_output=True,
        )
        if built.returncode != 0:
            return None

        def run(_: int) -> float | None:
            out = subprocess.run([str(binary)], capture_output=True, text=True)
            return float(out.stdout) if out.returncode == 0 else None  # no such instruction

        with ThreadPoolExecutor(threads) as pool:
            per_core = list(pool.map(run, range(threads)))
    if None in per_core:
        return None
    return sum(per_core) * instruction.multiply_adds
