"""The decoding engine: draft a token tree, verify it in one target forward, accept a prefix."""

import warnings

# transformers >= 5.24 renames a forward's `past_key_values` to `cache` and warns on every call;
# the engine passes `past_key_values`, which every transformers 5.x it supports accepts (the GPU
# image's 5.17 has no `cache`), so the warning says nothing a user can act on
warnings.filterwarnings(
    "ignore", message=r"`past_key_values` is deprecated", category=FutureWarning
)
