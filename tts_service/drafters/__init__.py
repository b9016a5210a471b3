"""Model-free drafters: each proposes a `DraftTree` from the context and learns from the verify."""
