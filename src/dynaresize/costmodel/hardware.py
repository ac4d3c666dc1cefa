"""Accelerators as the cost model sees them: one device of an 8-device node with one NIC each.

Every constant cites docs/references.md by section number, with the status letters of that
page ([V] verified, [S] secondary, [D] derived, [A] assumption). Re-exported by `costs`.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynaresize.errors import ConfigError

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator in an 8-device node with one NIC per device. The defaults are an H100
    SXM 80 GB with a 400 Gb/s NDR NIC; `HARDWARE_PRESETS` names the others."""

    name: str = "h100"
    hbm_bytes: float = 80 * GB  # H100 SXM (5)
    hbm_bw: float = 3.35e12  # H100 SXM HBM3 (5, [S])
    peak_flops: float = 989e12  # bf16 dense (vendor spec, [S])
    nic_bw: float = 47 * GB  # NCCL over one NDR NIC: 46-48 GB/s (5, [V])
    pcie_h2d_bw: float = 35 * GB  # nvbandwidth H2D (5, [V])
    pcie_d2h_bw: float = 53 * GB  # nvbandwidth D2H (5, [V])
    # NVLink 4 per direction (900 GB/s bidirectional, 5 [V]). Recorded, not read by the op costs:
    # they send shards over the NIC, the path between nodes (within one node, an upper bound).
    nvlink_bw: float = 450 * GB
    devices_per_node: int = 8


# Named accelerators (`--emulate ACCEL:MODEL`). Vendor figures are spec-sheet numbers [S]; the
# achieved NIC and PCIe rates of the other parts are derived [D] by the ratios measured on H100
# (NCCL 47 of 50 GB/s per NDR NIC; H2D 35 and D2H 53 of 63 GB/s over PCIe Gen5, docs/references.md 5).
HARDWARE_PRESETS: dict[str, Hardware] = {
    "h100": Hardware(),
    # H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s (references 5, spec pages [S]);
    # same node fabric (the MLCommons H200 system lists 400 Gb/s IB per GPU, references 5 [V]).
    "h200": Hardware(name="h200", hbm_bytes=141 * GB, hbm_bw=4.8e12),
    # A100 SXM4 80 GB: HBM2e at 2.039 TB/s, 312 TFLOPS bf16 dense, PCIe Gen4 32 GB/s per direction
    # (NVIDIA A100 datasheet [S]); one 200 Gb/s HDR NIC per GPU as in DGX A100 (NVIDIA DGX A100
    # datasheet [S]): 25 GB/s nominal, 23.5 achieved [D]; PCIe 32 x 35/63 = 17.8 H2D, 32 x 53/63
    # = 26.9 D2H [D].
    "a100": Hardware(name="a100", hbm_bytes=80 * GB, hbm_bw=2.039e12, peak_flops=312e12, nic_bw=23.5 * GB,
                     pcie_h2d_bw=17.8 * GB, pcie_d2h_bw=26.9 * GB, nvlink_bw=300 * GB),
    # H20 (HGX H20, the paper's part, arXiv 2607.22614): 96 GB HBM3 at 4.0 TB/s; 148 TFLOPS FP16/BF16
    # dense (296 FP8); NVLink 4 at 900 GB/s bidirectional; PCIe Gen5 x16 (NVIDIA's HGX H20
    # figures as published in secondary sources [S]: NVIDIA's own datasheet was not readable here).
    # NIC: one 400 Gb/s NDR port per GPU as in HGX H100 systems [A] (47 GB/s achieved, 5 [V]);
    # PCIe achieved rates as the H100's (same Gen5 x16 link, 5 [V]).
    "h20": Hardware(name="h20", hbm_bytes=96 * GB, hbm_bw=4.0e12, peak_flops=148e12),
}


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise ConfigError([f"accelerator={name!r}: unknown (known: {', '.join(HARDWARE_PRESETS)})"]) from None
