"""The runtime: the Python API over the patched llama.cpp (edgemoe.Engine).

- native: the one ctypes binding (llama-cpp-python's libllama + edgemoe's patch symbols);
- hooks: the routing callback that hands RouteRecords to policies;
- sampling: llama.cpp's sampler chain;  expert_cache: the expert slots and their controller;
- engine: the Engine, holding one part per concern (handle, exclusive, vocab, sequence, gating, prediction,
  routing); generation, chat: its generation loop and chat templates; config: LoadConfig.
"""
