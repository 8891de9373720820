"""The OpenAI-compatible HTTP API, served by aiohttp on the daemon's own event loop (README
"OpenAI-compatible API"): ``app`` (server, routes, middleware), ``openai`` (request and response
translation to and from the front end's ``Generate`` / ``GenerationStream``), ``sse`` (event
framing), ``errors`` (OpenAI error objects), ``auth`` (API keys and Unix peers)."""
