"""The docs' NumPy decoder now ships in the package: :mod:`rotary.examples.decoder` (this file re-exports it).

Run ``python docs/scripts/numpy_decoder.py`` (or ``python -m rotary.examples.decoder``) for greedy tokens of
Llama 3.1, Qwen3 and Gemma 3 text with random weights; docs/decoding.md ("The whole decoder") describes it and
:mod:`rotary.examples.engine` schedules requests over it.
"""

from rotary.examples.decoder import (FAMILIES, Config, Decoder, ModelCache, generate, hf_config, main,  # noqa: F401
                                     random_weights)

if __name__ == "__main__":
    main()
