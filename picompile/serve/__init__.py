"""Talking to an artifact: conversations with the model's chat template (``chat``), and an OpenAI-compatible HTTP
server (``app``: FastAPI on uvicorn; ``schemas``: the request and response bodies as pydantic models;
``scheduler``: requests in flight decoded together, one batched step for all of them)."""
