"""`edgemoe serve`: an OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn, SSE streaming).

- worker: the single engine thread and its bounded FIFO queue; stop strings;
- app: the routes (/v1/models, /v1/chat/completions, /v1/completions, /health) and API-key check;
- schemas: request models (pydantic) and the response bodies;
- errors: the OpenAI error shape and the exception handlers.

Needs the optional extra (pip install 'edgemoe[serve]'); the command itself is edgemoe.cli.serve.
Nothing here imports fastapi at package import time except app and errors.
"""
from __future__ import annotations
