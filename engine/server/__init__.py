"""The OpenAI-compatible HTTP server over the engine, with its event stream, control and /metrics."""
