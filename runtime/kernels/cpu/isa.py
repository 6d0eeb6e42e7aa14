"""The native CPU layer's instruction-set tiers: one ordered enum (isa.h mirrors its values), the
tiers this CPU has, and the one setting, BATCH_MANAGER_CPU_ISA, that caps the tier every kernel
family runs (tests force each tier; A/B runs). Each family runs its best tier at or below the cap
that the library compiled in (`bm_isa_mask`).

One rule for a bad value: a tier name that is unknown, or one this CPU lacks, is a ConfigError
naming the variable (or the `isa` argument) and the value.
"""
from __future__ import annotations

import enum
import functools
import os

from ...errors import ConfigError
from ...precision import cpu_flags

ENV_VAR = "BATCH_MANAGER_CPU_ISA"


class Isa(enum.IntEnum):
    """Ordered: a family runs its highest tier not above the cap (isa.h's enum Isa)."""
    SCALAR = 0
    AVX2 = 1          # AVX2 + FMA (+ F16C)
    AVXVNNI = 2       # AVX-VNNI (VEX vpdpbusd, ymm)
    AVX512 = 3        # AVX-512 F / BW / VL
    AVX512VNNI = 4    # AVX512-VNNI (zmm vpdpbusd)
    AVX512BF16 = 5    # AVX512-BF16 (vdpbf16ps)
    AMX = 6           # AMX-BF16 tiles (tdpbf16ps; the library also needs the OS's permission: isa.h)


# /proc/cpuinfo flags each tier needs (every tier above SCALAR also needs AVX2's)
_CPU_FLAGS = {Isa.SCALAR: (), Isa.AVX2: ("avx2", "fma"), Isa.AVXVNNI: ("avx2", "fma", "avx_vnni"),
              Isa.AVX512: ("avx2", "fma", "avx512f", "avx512bw", "avx512vl"),
              Isa.AVX512VNNI: ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
              Isa.AVX512BF16: ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
              Isa.AMX: ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")}
NAMES = {tier.name.lower(): tier for tier in Isa}


@functools.lru_cache(maxsize=None)
def cpu_tiers() -> tuple[Isa, ...]:
    """The tiers this CPU has, ascending."""
    flags = cpu_flags()
    return tuple(tier for tier in Isa if all(flag in flags for flag in _CPU_FLAGS[tier]))


def parse(value: str, field: str = ENV_VAR) -> Isa:
    """The tier `value` names; ConfigError naming `field` and the value when it is unknown or this
    CPU lacks it."""
    tier = NAMES.get(value.strip().lower())
    if tier is None:
        raise ConfigError(f"{field}: unknown ISA tier {value!r}; known: {', '.join(NAMES)}")
    if tier not in cpu_tiers():
        raise ConfigError(f"{field}={value!r}: this CPU lacks that tier; it has "
                          f"{', '.join(t.name.lower() for t in cpu_tiers())}")
    return tier


def cap(isa: str | None = None) -> Isa:
    """The cap to run under: the `isa` argument, else $BATCH_MANAGER_CPU_ISA, else this CPU's best tier."""
    if isa is not None:
        return parse(isa, "isa")
    value = os.environ.get(ENV_VAR, "").strip()
    return parse(value) if value else cpu_tiers()[-1]


def best_at_or_below(ceiling: Isa, offered: tuple[Isa, ...]) -> Isa:
    """The highest of `offered` (a family's tiers that the library compiled in) not above `ceiling`."""
    return max((tier for tier in offered if tier <= ceiling), default=Isa.SCALAR)


def compiled_tiers(lib) -> tuple[Isa, ...]:
    """The tiers the loaded library compiled in and this CPU supports (its bm_isa_mask)."""
    mask = int(lib.bm_isa_mask())
    return tuple(tier for tier in Isa if mask & (1 << tier))
