"""The continuous-batching engine of rotary.examples.engine (over rotary.examples.decoder) against Hugging Face
``generate``, greedy, on the random-weight float64 Llama 3.1 (llama3 scaling), Qwen3 (YaRN, q/k norms) and Gemma 3
text (sliding + global layers: two caches) models of tests/test_decoding_hf.py (which checks the plain decoder on a
left-padded batch):

* requests arriving at different steps on a cache too small for all of them (some wait), prefill chunks and
  decode tokens packed in one forward per step, EOS;
* parallel sampling by fork: each continuation of an n = 3 request is HF's, the prompt's pages held once;
* speculative rollback: drafts that are partly wrong, verified in one forward and truncated, give HF's tokens;
* prefix reuse: a request sharing an earlier prompt's first pages gives HF's tokens and prefills only the rest.

Without torch: position-independent reuse (a document's keys exported at 0.. and inserted at m equal a fresh
prefill of the document alone at m to 1e-12, and so do the logits of what follows), copy on write under sampled
forks, and the engine against ``generate`` on random weights.
"""

import functools

import numpy as np
import pytest

from rotary.examples import decoder as dec
from rotary.examples.engine import Engine, Request, ngram_draft

from .test_decoding_hf import FAMILIES, HOST_BACKENDS, _hf_generate, _hf_model

PROMPTS = [[5, 17, 3, 42, 8], [7, 9, 11, 13, 15, 17, 19, 21, 23], [60, 2], [33, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


@functools.lru_cache(maxsize=None)
def _hf(family):
    model, cfg, weights = _hf_model(family)
    return model, dec.Decoder(cfg, weights)


@functools.lru_cache(maxsize=None)
def _hf_tokens(family, prompt, max_new_tokens, eos=None):
    """HF greedy generate of one prompt alone (no padding), cut after eos."""
    tokens = _hf_generate(_hf(family)[0], [list(prompt)], max_new_tokens, eos_token_id=eos)[0][0].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def _expect(family, request, eos=None):
    return _hf_tokens(family, tuple(request.prompt), request.max_new_tokens, eos)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def _run_checked(engine):
    """Step ``engine`` to the end; after every step each decoding sequence's cache holds all its tokens but the
    newest (a rolled-back draft leaves nothing behind)."""
    while engine.waiting or engine.running:
        engine.step()
        for seq in engine.running:
            if not seq.todo and seq.out:
                assert engine.cache.lengths[seq.slot] == len(seq.tokens) - 1


# -- against HF ------------------------------------------------------------------------------------------------
@pytest.mark.peer
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_arrivals_and_waiting(family, backend):
    """Four requests arriving at steps 0, 0, 1, 3 on 12 pages of 4 tokens (the first two take 11 of them: the
    others wait); prompt chunks of at most 6 tokens a step packed with decode tokens."""
    _, decoder = _hf(family)
    engine = Engine(decoder, batch=3, page_size=4, num_pages=12, token_budget=6, backend=backend)
    requests = [Request(p, n, arrival=a) for p, n, a in zip(PROMPTS, (8, 6, 8, 5), (0, 0, 1, 3))]
    for r in requests:
        engine.submit(r)
    _run_checked(engine)
    for r in requests:
        assert r.tokens == _expect(family, r), (family, r.prompt)
    assert any(r.admitted_at > r.arrival for r in requests)                      # some waited
    assert any({phase for _, phase, _ in step} == {"prefill", "decode"} for step in engine.log)   # mixed steps
    assert max(sum(n for _, phase, n in step if phase == "prefill") for step in engine.log) <= 6
    assert sum(r.prefilled_tokens for r in requests) == sum(map(len, PROMPTS))


@pytest.mark.peer
def test_eos_stops_like_hf():
    """A continuation that emits eos stops there (its slot and pages freed; the others go on), as HF's does."""
    family = "llama"
    _, decoder = _hf(family)
    free_run = [_hf_tokens(family, tuple(p), 8) for p in PROMPTS]
    eos = next(run[j] for run in free_run for j in range(2, 8) if run[j] not in run[:j])
    engine = Engine(decoder, batch=4, page_size=4, num_pages=32, eos_token_id=eos)
    requests = engine.run([Request(p, 8, arrival=i) for i, p in enumerate(PROMPTS)])
    for r in requests:
        assert r.tokens == _expect(family, r, eos)
    assert any(r.tokens[-1] == eos and len(r.tokens) < 8 for r in requests)
    assert engine.cache.active.size == 0 and engine.cache.free_pages == 32   # every page free or only kept as a prefix


@pytest.mark.peer
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_fork_continuations(family, backend):
    """n = 3 continuations of a 9-token prompt: prefilled once, forked (its pages shared), each HF's tokens."""
    _, decoder = _hf(family)
    engine = Engine(decoder, batch=4, page_size=4, num_pages=24, backend=backend)
    req = engine.submit(Request(PROMPTS[1], 6, n=3))
    other = engine.submit(Request(PROMPTS[0], 6, arrival=1))
    engine.step()                                         # the prompt prefilled, the two others forked from it
    slots = [seq.slot for seq in engine.running]
    assert len(slots) == 3 and req.prefilled_tokens == 9
    for cache in engine.cache.caches:                     # every kind of layer: the 3 prompt pages held once
        assert np.all(cache.block_table[slots, :3] == cache.block_table[slots[0], :3])
    _run_checked(engine)
    expected = _expect(family, req)
    assert req.outputs == [expected] * 3 and other.tokens == _expect(family, other)


def _oracle_draft(answers, vocab):
    """A draft that knows the HF answers and gets the second token of every other proposal wrong."""
    calls = [0]

    def draft(tokens, k):
        calls[0] += 1
        for prompt, answer in answers:
            if tokens[:len(prompt)] == prompt:
                proposal = list(answer[len(tokens) - len(prompt):][:k])
                if calls[0] % 2 and len(proposal) > 1:
                    proposal[1] = (proposal[1] + 1) % vocab
                return proposal
        return []
    return draft


@pytest.mark.peer
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_speculative_rollback(family, backend):
    """Drafts of 3 tokens, partly wrong, verified by one forward each: the rejected ones are truncated away and the
    tokens are HF's (the cache holds exactly the accepted tokens after every step)."""
    _, decoder = _hf(family)
    requests = [Request(p, 10, arrival=i) for i, p in enumerate(PROMPTS[:3])]
    answers = [(r.prompt, _expect(family, r)) for r in requests]
    engine = Engine(decoder, batch=3, page_size=4, num_pages=30, draft=_oracle_draft(answers, 96), draft_tokens=3,
                    backend=backend)
    for r in requests:
        engine.submit(r)
    _run_checked(engine)
    for r, (_, answer) in zip(requests, answers):
        assert r.tokens == answer
    assert engine.accepted > 0 and engine.rejected > 0
    decode_steps = sum(1 for step in engine.log for _, phase, _ in step if phase == "decode")
    assert decode_steps < sum(len(r.tokens) - 1 for r in requests)               # fewer forwards than tokens


@pytest.mark.peer
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_prefix_reuse(family, backend):
    """A 13-token prompt, then one sharing its first 10 tokens (2 full pages of 4: 8 tokens cached, 5 prefilled),
    then the same prompt again (3 pages, all but the last token's page: 12 cached, 1 prefilled)."""
    _, decoder = _hf(family)
    first = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]
    engine = Engine(decoder, batch=2, page_size=4, num_pages=16, backend=backend)
    a = engine.run([Request(first, 6)])[0]
    b = engine.run([Request(first[:10] + [83, 27, 95], 6)])[0]
    c = engine.run([Request(first, 6)])[0]
    assert (a.cached_tokens, a.prefilled_tokens) == (0, 13)
    assert (b.cached_tokens, b.prefilled_tokens) == (8, 5)
    assert (c.cached_tokens, c.prefilled_tokens) == (12, 1)
    for r in (a, b, c):
        assert r.tokens == _expect(family, r), r.prompt


# -- without torch -----------------------------------------------------------------------------------------------
def _random_decoder(family, **overrides):
    cfg = dec.Config.from_hf(dec.hf_config(family, **overrides))
    return dec.Decoder(cfg, dec.random_weights(cfg, seed=5, dtype=np.float64))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_document_inserted_at_an_offset(family, backend):
    """A document prefilled alone at positions 0.. (export), inserted at m = 6 after a preamble (insert: one
    re-rotation by 6): every layer's keys equal a fresh prefill of the document alone at positions m.. to 1e-12
    (values too: the document's hidden states depend on relative positions only), and the logits of a question
    after it equal those after the fresh keys. The engine's request [preamble, document, question] continues
    with those tokens."""
    decoder = _random_decoder(family)
    preamble, doc_tokens, question = [11, 12, 13, 14, 15, 16], [40, 41, 42, 43, 44, 45, 46], [50, 51, 52]
    m, d = len(preamble), len(doc_tokens)
    cache = decoder.new_cache(4, page_size=4, num_pages=40, backend=backend)
    s = cache.add()
    decoder.forward([doc_tokens], cache, [s])
    chunks = cache.export(s)                              # keys rotated at 0 .. d - 1
    cache.free([s])
    moved = cache.add()
    decoder.forward([preamble], cache, [moved])
    cache.insert(moved, chunks)                           # ... now at m .. m + d - 1
    fresh = cache.add()                                   # the document alone, rotated at m .. m + d - 1
    decoder.forward([doc_tokens], cache, [fresh], positions=np.arange(m, m + d))
    for c, chunk in zip(cache.caches, chunks):
        for j in range(c.layers):
            keys, values = c.keys(moved, layer=j), c.values(moved, layer=j)
            np.testing.assert_allclose(keys[-d:], c.keys(fresh, layer=j), rtol=0, atol=1e-12)
            np.testing.assert_allclose(values[-d:], c.values(fresh, layer=j), rtol=0, atol=1e-12)
            assert np.abs(keys[-d:] - chunk.keys[j]).max() > 1e-3          # the re-rotation moved them
    # the same preamble followed by the fresh keys (inserted where they were rotated: no move)
    other = cache.add()
    decoder.forward([preamble], cache, [other])
    cache.insert(other, tuple(ch._replace(start=m) for ch in cache.export(fresh)))
    cache.free([fresh])
    logits = decoder.forward([question, question], cache, [moved, other])
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-12)
    # greedy on from there, and the engine's request with the document in its prompt
    tokens = [int(np.argmax(logits[1]))]
    for _ in range(4):
        tokens.append(int(np.argmax(decoder.forward([[tokens[-1]]], cache, [other])[0])))
    engine = Engine(decoder, batch=2, page_size=4, num_pages=24, token_budget=4, backend=backend)
    doc = engine.cache_document(doc_tokens)
    req = engine.run([Request(preamble + [doc] + question, 5)])[0]
    assert req.tokens == tokens
    assert (req.prefilled_tokens, req.inserted_tokens) == (m + len(question), d)


def test_forks_copy_on_write_under_sampling(family):
    """Sampled continuations (temperature 2) of one prompt diverge; the keys and values each holds are those of a
    fresh prefill of its own tokens (a shared page written by one of them never shows in another)."""
    decoder = _random_decoder(family)
    engine = Engine(decoder, batch=4, page_size=4, num_pages=32, temperature=2.0, seed=1)
    req = engine.submit(Request(PROMPTS[1], 12, n=4))     # 9 tokens: the third page is shared and partial
    for _ in range(6):
        engine.step()
    assert len({out[0] for out in req.outputs}) > 1       # different keys written into the shared page
    assert len(engine.running) == 4
    for seq in engine.running:
        ref = decoder.new_cache(1, 32)                    # its tokens (all but the newest) prefilled alone
        decoder.forward([seq.tokens[:-1]], ref)
        for c, r in zip(engine.cache.caches, ref.caches):
            start = c.held_from(seq.slot)                 # (a sliding-window cache has given earlier pages back)
            for j in range(c.layers):
                np.testing.assert_allclose(c.keys(seq.slot, layer=j), r.keys(0, layer=j)[start:], rtol=0, atol=1e-12)
                np.testing.assert_allclose(c.values(seq.slot, layer=j), r.values(0, layer=j)[start:], rtol=0,
                                           atol=1e-12)


def test_engine_gives_generate_tokens(family):
    """On random weights: the engine (arrivals, waiting, chunks, a fork, an n-gram draft, a reused prefix) gives the
    plain decoder's greedy tokens of each prompt."""
    decoder = _random_decoder(family)
    engine = Engine(decoder, batch=3, page_size=4, num_pages=14, token_budget=5, draft=ngram_draft, draft_tokens=2)
    requests = [Request(p, 7, n=2 if i == 1 else 1, arrival=i) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.submit(r)
    _run_checked(engine)
    again = engine.submit(Request(PROMPTS[3][:9] + [7, 7], 7, arrival=engine.clock))
    _run_checked(engine)
    for r in requests + [again]:
        assert r.outputs == dec.generate(decoder, [r.prompt], 7) * r.n
    assert any(r.admitted_at > r.arrival for r in requests) and again.cached_tokens == 8
