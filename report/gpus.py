"""GPUs for the planner's step times: each one's datasheet figures, with their sources, and what a
training step achieves of them (this host's own rates come from `make calibrate` instead).

A GPU's step is the one cost model the records use (report/costmodel.py), given the GPU's
Rates: the matmuls and attention at a fraction of the peak dense FLOP/s (ACHIEVED below), the
optimizer's step at the HBM bandwidth, and each mesh dim's bytes over NVLink inside a node or
the network across nodes at LINK_EFFICIENCY of the link."""

from __future__ import annotations

from dataclasses import dataclass

from report.costmodel import Rates

GB, TB = 1e9, 1e12


@dataclass(frozen=True)
class GPU:
    """A datasheet: peak dense (no 2:4 sparsity) tensor FLOP/s, HBM, and the bandwidth a GPU has
    to its node's GPUs (NVLink, one direction) and to other nodes (its NIC, one direction); for
    optimizer offload, its link to the host (PCIe, one direction) and its share of the host's
    memory bandwidth (the node's DRAM channels over its GPUs)."""

    name: str
    bf16_flops: float
    fp8_flops: float | None
    memory_gb: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    sources: str
    pcie_bytes_per_s: float
    host_memory_bytes_per_s: float


GPUS = {
    # NVIDIA's H100 datasheet: 1,979 TFLOP/s bf16 and 3,958 fp8 "with sparsity, 1/2 lower
    # without", 80 GB at 3.35 TB/s, NVLink 900 GB/s (both directions: NVIDIA's HGX H100 text,
    # NVIDIA/nccl#1264); DGX H100: one 400 Gb/s ConnectX-7 NDR port a GPU. torchtitan's
    # tools/utils.py takes 989e12 as the H100 SXM's bf16 peak.
    # Its host link, PCIe Gen5 x16: "128GB/s" both ways (the datasheet). DGX H100's two Xeon
    # Platinum 8480C, 8 DDR5-4800 channels each: 2 x 8 x 38.4 GB/s = 614 GB/s, 77 a GPU.
    "h100": GPU("H100 SXM 80 GB", 989e12, 1979e12, 80, 3.35 * TB, 450 * GB, 50 * GB,
                "NVIDIA H100 datasheet; DGX H100 user guide; NVIDIA/nccl#1264",
                pcie_bytes_per_s=64 * GB, host_memory_bytes_per_s=77 * GB),
    # The H100's compute (torchtitan's utils: 989e12) with 141 GB of HBM3e at 4.8 TB/s and the
    # same 18 NVLink 4 links (NVIDIA's MLPerf v4.1 H200 system: "18x 4th Gen NVLink, 900GB/s")
    # PCIe Gen5 x16 and DGX H200's host, DGX H100's (the same two Xeon 8480C)
    "h200": GPU("H200 SXM 141 GB", 989e12, 1979e12, 141, 4.8 * TB, 450 * GB, 50 * GB,
                "NVIDIA H200 announcement; MLPerf Inference v4.1 NVIDIA H200 system",
                pcie_bytes_per_s=64 * GB, host_memory_bytes_per_s=77 * GB),
    # NVIDIA's A100 datasheet: 312 TFLOP/s bf16 dense, 80 GB at 2,039 GB/s, NVLink 3 at 600 GB/s
    # (300 each way); DGX A100: eight 200 Gb/s HDR ports for compute, one a GPU. No fp8.
    # Its host link, PCIe Gen4 x16: "64GB/s" both ways. DGX A100's two EPYC 7742, 8 DDR4-3200
    # channels each: 2 x 8 x 25.6 GB/s = 410 GB/s, 51 a GPU.
    "a100": GPU("A100 SXM 80 GB", 312e12, None, 80, 2.039 * TB, 300 * GB, 25 * GB,
                "NVIDIA A100 datasheet; DGX A100 datasheet",
                pcie_bytes_per_s=32 * GB, host_memory_bytes_per_s=51 * GB),
    # NVIDIA's Blackwell datasheet at 1,000 W (torchtitan's utils: 2.25e15 bf16 dense), 4,500
    # fp8 dense, 180 GB (HGX B200) at 8 TB/s, NVLink 5 at 1.8 TB/s (both directions); DGX B200:
    # eight 400 Gb/s ConnectX-7 NDR ports
    # Its host link: DGX B200's Xeon Platinum 8570 speak PCIe Gen5 (the GPU's Gen6 waits for
    # the CPU), 64 GB/s each way; their 8 DDR5-5600 channels each, 2 x 8 x 44.8 = 717 GB/s, 90 a GPU
    "b200": GPU("B200 (HGX, 1,000 W)", 2250e12, 4500e12, 180, 8.0 * TB, 900 * GB, 50 * GB,
                "NVIDIA Blackwell datasheet; MLPerf Inference v6.0 Nebius B200 system; DGX "
                "B200 user guide", pcie_bytes_per_s=64 * GB, host_memory_bytes_per_s=90 * GB),
    # The H100s of torchtitan's published benchmarks (benchmarks/llama3_h100_202412_torchtitan.md):
    # "96GB HBM2e with 2.4 TB/sec", a 500 W limit, "400 Gb/s per GPU" between hosts; its MFU uses
    # the SXM's 989e12 ("the actual peak TFLOPs number is between SXM and NVL")
    "h100-96gb-500w": GPU("H100 96 GB HBM2e at 500 W (torchtitan's)", 989e12, 1979e12, 96,
                          2.4 * TB, 450 * GB, 50 * GB,
                          "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md; "
                          "its host taken as DGX H100's",
                          pcie_bytes_per_s=64 * GB, host_memory_bytes_per_s=77 * GB),
}

# What NCCL's collectives reach of a link: nccl-tests-style bus bandwidth over the datasheet's
# per-direction rate (NVIDIA/nccl#1264 measured 380 of 450 GB/s one way on H100 NVLink 4).
LINK_EFFICIENCY = 380 / 450
# A message's latency is left out on GPUs: NCCL's few microseconds a call, against steps of
# seconds, is under 1% at the planner's shapes.
# The optimizer's step reads and writes a parameter's fp32 master weight and two moments and
# reads its gradient (4 x 4 + 3 x 4 bytes): a pass over HBM, nothing to compute.
ADAMW_BYTES = 28
# Compute hides DDP's, FSDP's and context parallelism's bytes (NCCL runs on its own stream);
# TP's only with async TP (its matmuls decomposed to overlap them), the pipeline's and EP's
# all-to-all not at all.
GPU_OVERLAP = 1.0

# The rows that set ACHIEVED: torchtitan's Table 1, Llama 3.1 8B, FSDP on 8 of its H100s, local
# batch 2 of 8,192 tokens, per-op selective checkpointing (matmuls kept: no recompute counted),
# one row a way of running. Every other published row the tests hold the model to is left out.
LLAMA31 = {  # meta-llama's config.json (torchtitan's model args agree)
    "8B": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
           "vocab": 128256},
    "70B": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672,
            "vocab": 128256},
    "405B": {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248,
             "vocab": 128256},
}
FITTED_ON = {"eager": 5762, "compiled": 6667, "float8": 8532}  # tokens/s a GPU, Table 1


def llama_params(shape: dict) -> tuple[float, float]:
    """(all parameters, the input table's) of a Llama 3 shape: GQA attention, SwiGLU, untied."""
    h, kv = shape["hidden"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * shape["ffn"] + 2 * h
    table = shape["vocab"] * h
    return shape["layers"] * layer + 2 * table + h, table


def gpu_rates(gpu: GPU, achieved: float) -> Rates:
    """A GPU's Rates at `achieved` of its peak: links are named by mesh dim and where they run
    ("tp/nvlink", "dp/network"), priced per byte at LINK_EFFICIENCY of the link."""
    links = {f"{dim}/{where}": (0.0, 1 / (LINK_EFFICIENCY * rate))
             for dim in ("dp", "tp", "pp", "cp", "ep")
             for where, rate in (("nvlink", gpu.nvlink_bytes_per_s),
                                 ("network", gpu.network_bytes_per_s))}
    # optimizer offload: the copies over PCIe, and the host's AdamW as a pass over host memory
    links |= {"pcie/offload": (0.0, 1 / (LINK_EFFICIENCY * gpu.pcie_bytes_per_s)),
              "host/offload": (0.0, 1 / gpu.host_memory_bytes_per_s)}
    return Rates(gpu.bf16_flops * achieved, gpu.bf16_flops * achieved, 0.0,
                        ADAMW_BYTES / gpu.hbm_bytes_per_s, links, GPU_OVERLAP, gpu.name)
