"""The decoding engine: draft a token tree, verify it in one target forward, accept a prefix."""
