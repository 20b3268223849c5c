"""The OpenAI-compatible HTTP server (`kvasir serve`): FastAPI on uvicorn over the AsyncEngine.

`build_app(engine_config, server_config)` is the ASGI app; `run_server(...)` serves it with a
graceful drain on SIGTERM. See docs/serving.md for the endpoints, metrics and behaviour.
"""
