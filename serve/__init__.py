"""k3.serve: OpenAI-compatible server (issue 5)."""
