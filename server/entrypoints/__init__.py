"""The chat server's front ends: the WebSocket protocol, the OpenAI-compatible API, feedback
over HTTP, the admin API and console, and the web UI's files. They validate what comes in,
translate it into the turn service's commands (``server.turns``) and its items back into their
own wire formats; the services below know none of them."""
