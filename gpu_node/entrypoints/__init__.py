"""How a node is reached: its OpenAI-compatible routes, vLLM's operational routes, and
``kvledger node`` (build a node from settings, serve it with uvicorn). The only part of the node
that knows HTTP.
"""
