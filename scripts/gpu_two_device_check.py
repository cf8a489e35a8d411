"""Two-GPU check on a real model: SmolLM2-135M target on cuda:1, a 10-layer copy as draft on cuda:0,
and the target spread over both GPUs by an accelerate device map. Greedy output must equal HF
``generate()`` (float32); then one quick bf16 generation with timings.

    SPECSPLIT_CACHE=/tmp/specsplit-cache python scripts/gpu_two_device_check.py
"""

from __future__ import annotations

import json
import time

import torch
from transformers import GenerationConfig

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig, TargetConfig
from specsplit.models import load_model, load_tokenizer
from specsplit.models.self_draft import truncated_draft

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash map.",
    "Translate to French: The cat sleeps on the warm windowsill.",
]


def chat_ids(tok, prompt: str) -> torch.Tensor:
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def check(label: str, target, draft, tok, cfg: SpecSplitConfig, ref_device: str) -> dict:
    gc = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=target.generation_config.eos_token_id,
                          pad_token_id=tok.pad_token_id or 0)  # fmt: skip
    same, taus = 0, []
    with SpecSplitGenerator(target, draft, tokenizer=tok, config=cfg) as gen:
        for p in PROMPTS:
            ids = chat_ids(tok, p)
            with torch.inference_mode():
                ref = target.generate(ids.to(ref_device), generation_config=gc).cpu()
            out = gen.generate(ids, generation_config=gc, return_dict_in_generate=True)
            same += int(torch.equal(out.sequences, ref))
            taus.append(out.spec_stats.tau)
    row = {"check": label, "prompts": len(PROMPTS), "identical": same, "mean_tau": sum(taus) / len(taus)}
    print(json.dumps(row))
    return row


def main() -> None:
    n = torch.cuda.device_count()
    print(f"GPUs: {n} x {torch.cuda.get_device_name(0)}")
    d0, d1 = "cuda:0", f"cuda:{min(1, n - 1)}"
    tok = load_tokenizer("smollm2-135m")
    rows = []
    target = load_model("smollm2-135m", dtype=torch.float32, device=d1)
    draft = truncated_draft(load_model("smollm2-135m", dtype=torch.float32, device=d0), 10)
    for shape in ("chain", "static", "dynamic"):
        cfg = SpecSplitConfig(
            tree=TreeConfig(shape=shape), draft=DraftConfig(device=d0), target=TargetConfig(device=d1)
        )
        rows.append(check(f"draft {d0} / target {d1}, {shape}", target, draft, tok, cfg, d1))
    del target
    target_layers = 30
    half = target_layers // 2
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "lm_head": 0, "model.norm": n - 1}
    split.update({f"model.layers.{i}": (0 if i < half else n - 1) for i in range(target_layers)})
    sharded = load_model("smollm2-135m", dtype=torch.float32, device_map=split)
    print("device map devices:", sorted({str(v) for v in getattr(sharded, "hf_device_map", {}).values()}))
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape="static"), draft=DraftConfig(device=d0), target=TargetConfig(device_map=split)
    )
    first = next(sharded.parameters()).device
    rows.append(
        check("target split over both GPUs by a device map, static", sharded, draft, tok, cfg, str(first))
    )
    # one quick bf16 generation with the split placement
    target = load_model("smollm2-135m", dtype=torch.bfloat16, device=d1)
    draft = truncated_draft(load_model("smollm2-135m", dtype=torch.bfloat16, device=d0), 10)
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape="static"), draft=DraftConfig(device=d0), target=TargetConfig(device=d1)
    )
    with SpecSplitGenerator(target, draft, tokenizer=tok, config=cfg) as gen:
        gen.generate_text(PROMPTS[0], chat=True, max_new_tokens=16)  # warm-up
        t0 = time.perf_counter()
        text, stats = gen.generate_text(PROMPTS[0], chat=True, max_new_tokens=128, return_stats=True)
        dt = time.perf_counter() - t0
    s = stats.summary()
    print(json.dumps({"quick_generation_bf16": {"tokens": s["new_tokens"], "seconds": dt, "tau": s["tau"]}}))
    print(text[:400])


if __name__ == "__main__":
    main()
