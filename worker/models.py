"""The earlier name of ``worker.prepare_model``: ``python -m worker.models smollm2 [DIR]``, as
users know it, goes on preparing the real small chat model."""

from .prepare_model import main

if __name__ == "__main__":
    main()
