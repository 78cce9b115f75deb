"""`edgemoe serve`: an OpenAI- and Anthropic-compatible HTTP server over one Engine (FastAPI + uvicorn, SSE).

- worker: the single engine thread and its bounded FIFO queue; stop strings;
- app: the routes (/v1/models, /v1/chat/completions, /v1/completions, /v1/messages,
  /v1/messages/count_tokens, /v1/responses, /health), the API-key and body-size guard, keep-alive pings;
- schemas: OpenAI's request models and response bodies; anthropic: the Messages API's; responses: the
  Responses API's, served as a chat;
- conversation: what clients send shaped for the template (text parts, media, system turns, tool results,
  prefill); reasoning and stream: a reply split into reasoning, text and tool calls; grammar: output
  constraints (response_format, forced tool calls); scripted: scripted replies for tests;
- template: the GGUF's Jinja chat template (tools included); tools: parsing tool calls from the output;
- prefix_cache: which KV state a request starts from (the live one, a stored one), per API key;
- errors: the error shapes of both APIs and the exception handlers.

Needs the optional extra (pip install 'edgemoe[serve]'); the command itself is edgemoe.cli.serve.
Nothing here imports fastapi at package import time except app and errors.
"""

from __future__ import annotations
