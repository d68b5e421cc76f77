import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm():
    """The real default model, loaded once per test session (downloads it on first use)."""
    from infernix_jax.loader import load_model
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm_engine(smollm):
    from infernix_jax.engine import Engine
    return Engine(smollm, max_batch=4)
