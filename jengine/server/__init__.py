"""The HTTP server: SGLang's native /generate dialect and the OpenAI API over one Engine.

Reading order: cli.py (entrypoint, shutdown) -> app.py (routes, errors) -> async_engine.py (the
engine thread <-> event loop bridge) -> generate_api.py / openai_api.py (the two dialects) ->
inputs.py (checks against the model) -> metrics.py; gil.py (the serving process keeps the engine
thread fed). docs/serving.md documents every route.
"""
