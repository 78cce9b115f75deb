"""`edgemoe bench`, as llama-bench separates its jobs: rows (each row a plan() call: BenchRow), run (the runner
that measures a row, and run_bench), project (the simulator over the finished rows) and report (the printers).
The records they pass are in records."""
