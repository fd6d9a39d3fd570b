"""The accelerators a simulation's roofline times are computed for: peak dense compute, memory and link bandwidth.

Figures are NVIDIA's published specifications, dense (datasheets print tensor-core FLOPS with 2:4 structured
sparsity, marked with an asterisk: half of that is the dense figure used here); NVLink is per direction (datasheets
print the bidirectional total). H20 has no public NVIDIA datasheet: its figures are the commonly reported ones. `fp32`
is the non-tensor-core FP32 rate (PyTorch runs FP32 matmuls without TF32 by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TERA = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: dense peak TFLOPS by dtype, HBM capacity (GB, 10^9 bytes) and bandwidth (TB/s), NVLink GB/s
    per direction, compute capability (what `torch.cuda.get_device_capability` answers in a simulation), source."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    fp32_tflops: float
    memory_gb: float
    hbm_tbps: float
    nvlink_gbps: float
    capability: tuple[int, int]
    source: str

    def peak_flops(self, dtype: torch.dtype | None) -> float:
        """FLOP/s of a matmul-class op whose operands are `dtype` (fp8 without fp8 units runs at the bf16 rate)."""
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return (self.fp8_tflops or self.bf16_tflops) * TERA
        if dtype in (torch.float32, torch.float64):
            return self.fp32_tflops * TERA
        return self.bf16_tflops * TERA

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def roofline_s(self, flops: float, moved_bytes: float, dtype: torch.dtype | None) -> float:
        """An op's time bound: the larger of its FLOPs at peak compute and its bytes at HBM bandwidth."""
        return max(flops / self.peak_flops(dtype), moved_bytes / (self.hbm_tbps * TERA))


DEVICE_SPECS = {
    spec.name: spec
    for spec in (
        DeviceSpec(
            "H200", 989.0, 1979.0, 67.0, 141.0, 4.8, 450.0, (9, 0),
            "https://www.nvidia.com/en-us/data-center/h200/ (BF16 1,979 and FP8 3,958 TFLOPS with sparsity; 141 GB "
            "HBM3e at 4.8 TB/s; NVLink 900 GB/s bidirectional)",
        ),
        DeviceSpec(
            "H100", 989.0, 1979.0, 67.0, 80.0, 3.35, 450.0, (9, 0),
            "https://www.nvidia.com/en-us/data-center/h100/ (SXM5: BF16 1,979 and FP8 3,958 TFLOPS with sparsity; 80 "
            "GB HBM3 at 3.35 TB/s; NVLink 900 GB/s bidirectional)",
        ),
        DeviceSpec(
            "H20", 148.0, 296.0, 44.0, 96.0, 4.0, 450.0, (9, 0),
            "no NVIDIA datasheet; as reported (e.g. https://www.tweaktown.com/news/95224/): FP16/BF16 148 and FP8 296 "
            "TFLOPS dense, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s bidirectional",
        ),
        DeviceSpec(
            "B200", 2250.0, 4500.0, 75.0, 180.0, 7.7, 900.0, (10, 0),
            "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 per GPU: FP16/BF16 4.5 and FP8 9 PFLOPS with "
            "sparsity; 180 GB HBM3e at 7.7 TB/s; NVLink 1.8 TB/s bidirectional)",
        ),
        DeviceSpec(
            "A100", 312.0, None, 19.5, 80.0, 2.039, 300.0, (8, 0),
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (SXM4 80GB: BF16 312 | 624* TFLOPS, no FP8; 80 GB "
            "HBM2e at 2,039 GB/s; NVLink 600 GB/s)",
        ),
    )
}  # fmt: skip


def device_spec(name: str) -> DeviceSpec:
    """The spec of `name` (case-insensitive), or a ValueError naming the ones there are."""
    for key, spec in DEVICE_SPECS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"Unknown device spec {name!r}: choose one of {', '.join(DEVICE_SPECS)}.")
