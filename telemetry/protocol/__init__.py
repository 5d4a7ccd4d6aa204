"""The event and control protocol that every batchtop server speaks (`batchtop serve`, and
batchtop's scheduler inside vLLM): knobs, the command queue, the event stream, the routes, the
access rules and the server thread. A leaf of telemetry: the vLLM guest imports it.

- `knob` — `Knob`: a live knob's type, range, label and when it applies; one check.
- `commands` — `CommandQueue`: bounded, applied before a step; pause, resume, single steps.
- `stream` — `EventRing`, the resumable server-sent event stream, the schema its hello names.
- `routes` — `ControlHost` (what a server supplies) and the one APIRouter over it.
- `guard` — the bind rule, API key, Host and Origin rules and body limit (`Guard`, ASGI).
- `errors` — OpenAI-shaped error bodies, `ApiError`.
- `runner` — uvicorn in a thread or in the foreground.
"""
