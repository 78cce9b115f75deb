"""The simulator's replay (edgemoe.perf.model.simulate runs it): a `Run` (run.py) times each step layer by
layer over a copy stream (stream.py), and every feature a configuration has (the expert cache, the gate,
stock's GPU layers, op offload, the prefill assignment, --device-prefill, pre-calculation, the decode split,
host-read routing, the CPU/GPU overlap) is a `Feature` (feature.py) in a module of its own, composed for a
`Config` by features.py: a new feature plugs in as one more `Feature`, not as a branch of the run."""
