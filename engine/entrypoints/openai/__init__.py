"""OpenAI-compatible HTTP API: `api_server.build_app(loop)` / `python -m engine.entrypoints.openai.api_server`."""
