"""The HF zoo: every text ``*RotaryEmbedding`` class of the installed transformers, built from its default
config (each layer type), against ``RopeSpec.from_hf_config`` (see tests/hf_zoo.py for what is compared).

Fails on any mismatch or refusal; lists the classes HF cannot build and the deliberate exceptions.
docs/models.md is generated from the passing rows and checked here (for the transformers version it
was generated with).
"""

import os
import pathlib
import warnings

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.peer, pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                                   reason="needs transformers >= 5 (rope_parameters)")]

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "models.md"


@pytest.fixture(scope="module")
def zoo():
    from tests import hf_zoo

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hf_zoo.run_zoo()


def test_every_text_rotary_class_is_reproduced(zoo):
    rows, failures, unbuildable, skipped = zoo
    for family, cls_name, error in unbuildable:
        warnings.warn(f"HF cannot build {family}.{cls_name} from its default config: {error}", stacklevel=1)
    assert len(rows) > 150, f"only {len(rows)} classes compared: the walk is broken"
    assert not failures, f"{len(failures)} classes differ from HF:\n" + "\n".join(failures)


def test_models_doc_is_generated_from_the_zoo(zoo):
    from tests import hf_zoo

    rows, failures, _, skipped = zoo
    text = hf_zoo.models_markdown(rows, skipped, transformers.__version__)
    if os.environ.get("ROTARY_UPDATE_MODELS_DOC"):
        DOC.write_text(text, encoding="utf-8")
    current = DOC.read_text(encoding="utf-8")
    if f"(transformers {transformers.__version__};" not in current:
        pytest.skip(f"docs/models.md was generated with another transformers than {transformers.__version__}")
    assert current == text, "docs/models.md is stale: run ROTARY_UPDATE_MODELS_DOC=1 python -m pytest tests/test_hf_zoo.py"
