"""Performance, by job: `model` (pure: machine profiles, the cost model, workloads, the simulator, the
backtest and `edgemoe plan`'s layouts; no native library, no Engine), `measure` (the ggml microbenchmarks
and `edgemoe profile`, through the native library) and `bench` (`edgemoe bench`: the engine benchmark)."""
