"""Ray Serve HTTP endpoint: OpenAI-compatible completions plus best-of-N solve."""
