"""Policies: pure Python decisions over routing records, no native code and no Engine.

- route: RouteRecord (one MoE layer's routing as numpy arrays) and the RoutePolicy protocol;
- gating: adaptive top-k rules that drop experts a token does not need;
- registry: one PolicySpec per residency policy (its config record, build, replays, calibration stages, native
  step, request options, help); kinds: one module per policy with its record and its registration;
- residency: which experts stay in the expert cache's slots (LRU, DALI, DAOP, static, manual);
  daop: DAOP's placement and per-prompt swap; degrade: DAOP's graceful degradation (a route policy);
  loads: the Load record every residency policy answers with;
- allocation: how many slots each MoE layer gets (AdapMoE's DP over replayed costs);
- assignment: which active experts of a ubatch run on the CPU and which on the GPU (DALI's greedy).
Prefetch policies go here too (promoe: ProMoE's; dali_prefetch: DALI's). The runtime wires them to llama.cpp.
"""

from . import kinds as kinds  # registers every residency policy (edgemoe.policies.registry)
