"""Greedy exactness on a real model: SmolLM2-135M (float32) with a draft made of its first layers."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.models.self_draft import truncated_draft

pytestmark = pytest.mark.real

DRAFT_LAYERS = 10  # of 30: cheap, accepted only sometimes (a chain of its top-1 guesses rarely is)

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash map.",
    "Translate to French: The cat sleeps on the warm windowsill.",
]


@pytest.fixture(scope="module")
def smollm2():
    from specsplit.models import load_model, load_tokenizer
    from tests._real_models import smollm2_dir

    path = smollm2_dir()
    model = load_model(path, dtype="float32", device="cpu")
    tok = load_tokenizer(path)
    return model, tok


def _chat_ids(tok, prompt):
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "tree, prompts",
    [
        (TreeConfig(shape="static"), PROMPTS),
        (TreeConfig(shape="chain", num_draft_tokens=5), PROMPTS[:2]),
        (TreeConfig(shape="dynamic", topk=4, width=4, budget=16, max_depth=6), PROMPTS[2:4]),
    ],
    ids=["static", "chain", "dynamic"],
)
def test_smollm2_greedy_equals_hf(smollm2, tree, prompts):
    model, tok = smollm2
    draft = truncated_draft(model, DRAFT_LAYERS)
    gc = GenerationConfig(
        max_new_tokens=64, do_sample=False, eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
    )  # fmt: skip
    gen = SpecSplitGenerator(model, draft, tokenizer=tok, config=SpecSplitConfig(tree=tree))
    taus = []
    for prompt in prompts:
        ids = _chat_ids(tok, prompt)
        with torch.inference_mode():
            ref = model.generate(ids, generation_config=gc)
        out = gen.generate(ids, generation_config=gc, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (prompt, tok.decode(out.sequences[0]), tok.decode(ref[0]))
        taus.append(out.spec_stats.tau)
    gen.close()
    if tree.shape != "chain":  # several candidates per level: the self-draft is accepted sometimes
        assert sum(taus) / len(taus) > 1.05


def test_smollm2_batch_with_padding(smollm2):
    import copy

    model, tok = smollm2
    tok = copy.deepcopy(tok)
    tok.padding_side = "left"
    if tok.pad_token is None:  # SmolLM2 ships none; HF's own advice
        tok.pad_token = tok.eos_token
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS[:3]
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    gc = GenerationConfig(
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with SpecSplitGenerator(model, truncated_draft(model, DRAFT_LAYERS), tokenizer=tok) as gen:
        out = gen.generate(enc["input_ids"], attention_mask=enc["attention_mask"], generation_config=gc)
    for i, t in enumerate(texts):  # each row equals its own unpadded greedy decoding
        ids = tok(t, return_tensors="pt", add_special_tokens=False)["input_ids"]
        ref = model.generate(ids, generation_config=gc)[0, ids.shape[1] :]
        new = out[i, enc["input_ids"].shape[1] :]
        assert torch.equal(new[: ref.shape[0]], ref)
