"""The runtime: the Python API over the patched llama.cpp (edgemoe.Engine).

- native: the one ctypes binding (llama-cpp-python's libllama + edgemoe's patch symbols);
- hooks: the routing callback that hands RouteRecords to policies;
- sampling: llama.cpp's sampler chain;  expert_cache: the expert slots and their controller;
- config, engine, generation, chat, routing: the Engine, one concern per module.
"""
