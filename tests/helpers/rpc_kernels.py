"""Imported first by the scripts that compare runs on the RPC device with stock bitwise (rpc_cache_check.py,
rpc_overlap_archs.py, ids_check_child.py), before llama.cpp computes anything.

The RPC device runs the CPU's kernels, which pick a mul_mat_id path per expert by its row count (the tiled one from
8 rows, ggml-cpu/tiled). The rows that a device's skipped ids are filled with (patch "moe: id rows that a device's
mul_mat_id accepts") add rows to some slots when no unread slot is left, and so change the last bits of those slots'
outputs. Forced (GGML_CPU_TILED_MM_FORCE, ggml's own switch, read once), the tiled path gives each output the same
bits whatever the count, in the cached run and in the stock run it is compared with.
"""
from __future__ import annotations

import os

os.environ.setdefault("GGML_CPU_TILED_MM_FORCE", "1")
