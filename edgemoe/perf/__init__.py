"""Performance: benchmarks of stock placements against the expert cache (bench); profiling and
simulation go here next."""
