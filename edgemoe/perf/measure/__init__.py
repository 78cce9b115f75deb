"""Measurements of this machine through the native library: the ggml microbenchmarks (microbench, over the
graph bindings in ggml_graph) and `edgemoe profile` (profiling), which fits the performance model's
profile (edgemoe.perf.model.profile) to them."""
