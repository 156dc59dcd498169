"""Whether bf16 pays on this CPU, and the one line a run that asks for it where it does not prints at start-up.

    bf16_units(flags, cap)            # "amx", "avx512_bf16" or "none": the bf16 units oneDNN may use here
    line = slow_bf16_line(cfg, on_cpu=True, units=bf16_units(cpu_flags()))   # None, or one line

Measured on 2 threads, 2048^3 products (experiments/README.md, "Memory at real sizes"): a Xeon with AMX, fp32 105-113 GFLOP/s and bf16 553 with
AMX tiles, 65 with oneDNN capped at AVX512_CORE_BF16; an AMD EPYC with AVX512-BF16 and no AMX, fp32 178
and bf16 411; AVX2 machines, which have no bf16 instructions, about 50x slower in bf16 than in fp32. A run
asking for bf16 where there are no bf16 instructions is told so in one line instead of silently taking
hours; with AVX512-BF16 the measurements disagree by CPU, so nothing is said. `ONEDNN_MAX_CPU_ISA`
(oneDNN's cap, which emulates an older CPU) is read as oneDNN reads it.
"""

from __future__ import annotations

from typing import Literal

from configs import Config

Units = Literal["amx", "avx512_bf16", "none"]


def bf16_units(flags: set[str], onednn_cap: str | None = None) -> Units:
    """The bf16 units oneDNN may use: the CPU's flags (/proc/cpuinfo names) within `ONEDNN_MAX_CPU_ISA`."""
    cap = (onednn_cap or "ALL").upper()
    if "amx_bf16" in flags and ("AMX" in cap or cap in ("ALL", "DEFAULT")):
        return "amx"
    if "avx512_bf16" in flags and ("BF16" in cap or "AMX" in cap or cap in ("ALL", "DEFAULT")):
        return "avx512_bf16"
    return "none"


def cpu_flags() -> set[str]:
    """This CPU's flags from /proc/cpuinfo (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def slow_bf16_line(cfg: Config, *, on_cpu: bool, units: Units) -> str | None:
    """One line when the run computes in bf16 on a CPU without bf16 instructions, else None."""
    flags = [f"--model.{name.replace('_', '-')} bfloat16" for name in ("dtype", "compute_dtype")
             if getattr(cfg.model, name) == "bfloat16"]  # fmt: skip
    if not on_cpu or not flags or units != "none":
        return None
    return (f"warning: {' and '.join(flags)} on a CPU without bf16 instructions (neither AVX512-BF16 nor AMX): "
            "its bf16 products run about 50x slower than float32 (measured on AVX2); float32, the default, "
            "is faster here")  # fmt: skip
