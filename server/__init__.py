"""The ASGI server: WebSocket chat, OpenAI-compatible API, admin and lineage API, auth,
harness, router and engines."""
