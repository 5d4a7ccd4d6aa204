"""The servers' default limits (no imports: the command-line parsers read them)."""
MAX_BODY_BYTES = 2 * 2**20   # a 128k-token prompt as token ids is ~1 MB of JSON
DRAIN_BYTES = 16 * 2**20     # an oversized body is read and dropped up to this, so its client reads the 413
MAX_COMMANDS = 4096          # commands queued for an engine thread before new ones are refused
MAX_WAITING = 1024           # `batchtop serve`: requests waiting for admission before new ones get 429
MAX_PROMPTS = 256            # `batchtop serve`: prompts in one completion request
RETRY_AFTER_S = 1            # what a 429 or 503 for a full queue asks the client to wait
