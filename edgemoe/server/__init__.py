"""`edgemoe serve`: an OpenAI- and Anthropic-compatible HTTP server over the engine (see app.py, engine_loop.py).

Nothing is imported here, so that `edgemoe.server.cli` can register its flags without loading the web stack.
"""
