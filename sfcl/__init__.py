"""SFCL: an LLM inference server with an event-triggered semantic fidelity check.

Layers (see README.md): ``sfcl.model`` (weights + our Llama-family forward with per-layer taps),
``sfcl.engine`` (scheduler without torch, model runner, engine thread), ``sfcl.snapshot``
(triggers + snapshotter), ``sfcl.anchors`` (static anchor library: build, store, search),
``sfcl.server`` (Anthropic Messages and OpenAI Chat Completions over HTTP/SSE).
"""

__version__ = "0.1.0"
