"""k3.serve: the OpenAI-compatible server and its continuous-batching engine (docs/serving.md)."""
