"""Policies: pure Python decisions over routing records, no native code and no Engine.

- route: RouteRecord (one MoE layer's routing as numpy arrays) and the RoutePolicy protocol;
- gating: adaptive top-k rules that drop experts a token does not need;
- residency: which experts stay in the expert cache's slots (LRU, static, manual);
- assignment: which active experts of a ubatch run on the CPU and which on the GPU (DALI's greedy).
Prefetch and placement policies go here too. The runtime wires them to llama.cpp.
"""
