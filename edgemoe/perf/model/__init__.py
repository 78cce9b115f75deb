"""The performance model, pure: machine profiles (profile), the cost model (costmodel), model shapes
(shapes), workloads (workload), the simulator (simulate, with its features in sim/), the backtest against
published measurements (backtest), `edgemoe plan`'s layouts (layouts) and the simulation's report (report).
Nothing here loads the native library or builds an Engine (tests/test_layering.py checks it)."""
