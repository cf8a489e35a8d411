"""Where does a round's time go? One generation with the per-round split and a torch profiler table.

python scripts/profile_generate.py --target smollm2-135m --draft self:10 --device cuda:0 [--cuda-graphs]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specsplit import SpecSplitConfig, SpecSplitGenerator, TreeConfig
from specsplit.config import DraftConfig, EngineTuning, TargetConfig
from specsplit.models import load_model, load_tokenizer
from specsplit.models.self_draft import truncated_draft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="self:10")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--draft-device", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tree", default="static")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--compile", action="store_true", help="fuse the graph steps with torch.compile")
    ap.add_argument(
        "--levels", action="store_true", help="dynamic tree: one graph per level (graph_rounds off)"
    )
    ap.add_argument(
        "--sort", default="self_cpu_time_total", help="profiler table order, e.g. self_cuda_time_total"
    )
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    ddev = a.draft_device or a.device
    target = load_model(a.target, dtype=dtype, device=a.device)
    if a.draft == "same":
        draft = load_model(a.target, dtype=dtype, device=ddev)
    elif a.draft.startswith("self:"):
        draft = truncated_draft(load_model(a.target, dtype=dtype, device=ddev), int(a.draft[5:]))
    else:
        draft = load_model(a.draft, dtype=dtype, device=ddev)
    tok = load_tokenizer(a.target)
    cfg = SpecSplitConfig(
        tree=TreeConfig(shape=a.tree),
        draft=DraftConfig(
            device=ddev,
            cuda_graphs=a.cuda_graphs,
            compile=a.compile,
            tuning=EngineTuning(graph_rounds=not a.levels),
        ),
        target=TargetConfig(device=a.device, cuda_graphs=a.cuda_graphs, compile=a.compile),
    )
    prompt = "Write a Python function that checks whether a number is prime, with tests."
    ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True),
              return_tensors="pt", add_special_tokens=False)["input_ids"]  # fmt: skip
    gen = SpecSplitGenerator(target, draft, tokenizer=tok, config=cfg)
    gen.generate(ids, max_new_tokens=a.tokens, eos_token_id=[])  # warm-up (graph capture, compile)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = gen.generate(ids, max_new_tokens=a.tokens, return_dict_in_generate=True, eos_token_id=[])
    sync()
    dt = time.perf_counter() - t0
    s = out.spec_stats.summary()
    print(
        json.dumps(
            {k: s[k] for k in ("new_tokens", "rounds", "tau", "mean_draft_s", "mean_verify_s", "mean_host_s")}
        )
    )
    print(f"specsplit: {s['new_tokens'] / dt:.1f} tok/s")
    with torch.inference_mode():
        target.generate(ids.to(a.device), max_new_tokens=16, do_sample=False)
        sync()
        t0 = time.perf_counter()
        r = target.generate(
            ids.to(a.device), max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False
        )
        sync()
    print(f"HF target-only: {(r.shape[1] - ids.shape[1]) / (time.perf_counter() - t0):.1f} tok/s")
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with torch.profiler.profile(activities=acts) as prof:
        gen.generate(ids, max_new_tokens=32, eos_token_id=[])
        sync()
    print(prof.key_averages().table(sort_by=a.sort, row_limit=25))
    print(json.dumps({"gpu_busy": gpu_busy(prof)}))
    gen.close()


def gpu_busy(prof: torch.profiler.profile) -> dict[str, float]:
    """Union of GPU kernel/memcpy intervals over the profiled window: how much of it the GPU worked."""
    spans, cpu = [], []
    for e in prof.events():
        tr = e.time_range
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((tr.start, tr.end))
        else:
            cpu.append((tr.start, tr.end))
    if not spans or not cpu:
        return {}
    spans.sort()
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = max(e for _, e in cpu + spans) - min(s for s, _ in cpu + spans)
    return {"window_ms": window / 1e3, "gpu_busy_ms": busy / 1e3, "busy_fraction": busy / window,
            "gpu_events": float(len(spans))}  # fmt: skip


if __name__ == "__main__":
    main()
