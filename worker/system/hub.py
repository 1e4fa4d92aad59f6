"""A ``--model`` that is a Hugging Face hub id, checked against the hub in seconds at start.

vLLM and transformers fetch such a model from the hub as they load it, and retry a hub they
cannot reach: a model that was not there (or no network) took 57 s of retries, warnings and
an ``OSError`` traceback to fail, after the broker check and the imports. The configuration
check (config/loader.py) refuses at once what it can see on disk: a path that does not exist,
and a hub id that is not in the Hugging Face cache while downloads are off (``HF_HUB_OFFLINE``).
What needs the hub is asked here, once, with a short timeout, before anything loads: whether
the hub has the model, or cannot be reached at all. A model in the cache starts from there
when the hub cannot be reached: downloads are turned off for this process and the engine's,
instead of a minute of retries.
"""

from __future__ import annotations

import os

from loguru import logger

from ..config.loader import model_not_found

# Seconds to wait for the hub's answer. Its answers take well under a second from a network
# that reaches it; a name that does not resolve fails at once; a network that drops packets
# waits this long.
HUB_TIMEOUT = 3.0


def check_hub_model(model: str, *, cached: bool, timeout: float = HUB_TIMEOUT) -> str | None:
    """None when the start can go on: the hub has ``model`` (vLLM downloads what the cache
    lacks), or the hub cannot be reached and the cache has it (``cached``: then downloads are
    turned off). Otherwise the error to report: what was looked for and what to do."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        huggingface_hub.model_info(model, timeout=timeout)
    except GatedRepoError:
        why = (
            "the Hugging Face hub keeps it behind its terms: accept them on its page, then log in "
            "(hf auth login) or set HF_TOKEN"
        )
    except RepositoryNotFoundError:
        why = (
            "the Hugging Face hub has no such model (a private one needs a login: hf auth login, or set HF_TOKEN), "
            f"and there is no directory {os.path.abspath(model)}"
        )
    except HfHubHTTPError as exc:  # the hub answered, with an error of its own
        why = f"the Hugging Face hub refused it: {exc}"
    except Exception as exc:  # the HTTP client's errors: no connection, a timeout, TLS
        if cached:
            logger.warning(
                "The Hugging Face hub ({}) cannot be reached ({}): loading {} from the cache, downloads off",
                constants.ENDPOINT,
                exc,
                model,
            )
            os.environ["HF_HUB_OFFLINE"] = "1"  # for vLLM's engine processes too
            constants.HF_HUB_OFFLINE = True  # read by vLLM and transformers as they load
            return None
        why = (
            f"there is no directory {os.path.abspath(model)}, the Hugging Face cache does not have it, "
            f"and the hub ({constants.ENDPOINT}) cannot be reached ({exc})"
        )
    else:
        return None
    return model_not_found(model, why, hub=True)
