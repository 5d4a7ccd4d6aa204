"""The dashboard over a stock server's /metrics: the source, its widgets and its app."""
