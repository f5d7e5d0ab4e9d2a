"""Datasheet figures of the accelerators the benchmarks divide by, found by `device_kind`.

    chip = find(jax.devices()[0].device_kind)     # None for a CPU or an unknown kind
    chip.name, chip.bf16_flops, chip.f32_flops, chip.hbm_bytes_per_s

Model FLOP utilisation divides by the dense (no 2:4 sparsity) peak of the dtype; a decoding
step's memory bound divides by the HBM bandwidth. Each figure is the vendor's published
one (bench/accelerator.md names the sources); a kind that matches none gives None, and
`python -m bench.accelerator --bandwidth` / `--peak-flops` stand in.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's datasheet.

    Attributes:
        name: what the tables print.
        match: lower-case substrings a `device_kind` must all contain.
        bf16_flops: dense bfloat16 matrix FLOP/s.
        f32_flops: dense float32 FLOP/s (not TF32), None where unpublished.
        hbm_bytes_per_s: memory bandwidth, bytes/s.
    """

    name: str
    match: tuple[str, ...]
    bf16_flops: float
    f32_flops: float | None
    hbm_bytes_per_s: float

    def peak(self, dtype: str) -> float | None:
        return {"bfloat16": self.bf16_flops, "float32": self.f32_flops}.get(dtype)


# The first entry whose substrings all occur wins: PCIe and NVL before the SXM parts.
CHIPS = (
    Chip("H100 PCIe", ("h100", "pcie"), 756e12, 51e12, 2.0e12),
    Chip("H100 NVL", ("h100", "nvl"), 835e12, 60e12, 3.9e12),
    Chip("H100 SXM", ("h100",), 989e12, 67e12, 3.35e12),
    Chip("H200", ("h200",), 989e12, 67e12, 4.8e12),
    Chip("GH200", ("gh200",), 989e12, 67e12, 4.0e12),
    Chip("A100 40GB PCIe", ("a100", "pcie", "40gb"), 312e12, 19.5e12, 1.555e12),
    Chip("A100 80GB PCIe", ("a100", "pcie"), 312e12, 19.5e12, 1.935e12),
    Chip("A100 40GB", ("a100", "40gb"), 312e12, 19.5e12, 1.555e12),
    Chip("A100 80GB", ("a100",), 312e12, 19.5e12, 2.039e12),
    Chip("L40S", ("l40s",), 362e12, 91.6e12, 0.864e12),
    Chip("L40", ("l40",), 181e12, 90.5e12, 0.864e12),
    Chip("L4", ("l4",), 121e12, 30.3e12, 0.3e12),
    Chip("TPU v4", ("tpu v4",), 275e12, None, 1.2e12),
    Chip("TPU v5e", ("tpu v5 lite",), 197e12, None, 0.819e12),
    Chip("TPU v5p", ("tpu v5",), 459e12, None, 2.765e12),
    Chip("TPU v6e", ("tpu v6",), 918e12, None, 1.64e12),
)


def find(device_kind: str) -> Chip | None:
    """The datasheet of `device_kind` (as `jax.devices()[0].device_kind` spells it, e.g.
    "NVIDIA H100 80GB HBM3"), or None."""
    kind = device_kind.lower()
    for chip in CHIPS:
        if all(part in kind for part in chip.match):
            return chip
    return None
