"""The engine core: requests, the KV cache, the scheduler, the persistent batch, the engine and its loop."""
