"""Constrained output under speculation: a logits processor that only lets the model write a JSON
array of integers, applied exactly as Hugging Face ``generate()`` applies it, and faster.

    python examples/constrained_json.py
    python examples/constrained_json.py --target smollm2-135m --draft smollm2-135m   # small, CPU-friendly

SpecSplit runs the processor on every row of every verified tree with that row's own context, so
the output is HF ``generate()``'s (greedy: token for token; the script checks it), while n-gram
drafts, which are cheap, do well on structured text that repeats its own punctuation.

The processor is an ordinary HF ``LogitsProcessor``: a small automaton over characters, with the
tokens each state allows precomputed once from the tokenizer's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

# States of  "[" " "* ( int ( " "* "," " "* int )* )? " "* "]"
START, OPEN, NUMBER, COMMA, AFTER_NUMBER, DONE = range(6)
_MOVES = {
    START: {"[": OPEN},
    OPEN: {" ": OPEN, "]": DONE, **{d: NUMBER for d in "0123456789"}},
    NUMBER: {",": COMMA, " ": AFTER_NUMBER, "]": DONE, **{d: NUMBER for d in "0123456789"}},
    COMMA: {" ": COMMA, **{d: NUMBER for d in "0123456789"}},
    AFTER_NUMBER: {" ": AFTER_NUMBER, ",": COMMA, "]": DONE},
    DONE: {},
}


def _walk(state: int, text: str) -> int:
    """The state after ``text`` (-1: ``text`` leaves the grammar)."""
    for ch in text:
        state = _MOVES[state].get(ch, -1)
        if state < 0:
            return -1
    return state


class JsonIntArrayProcessor(LogitsProcessor):
    """Allow only tokens that keep the generated text a prefix of a JSON array of integers; once
    the array is closed, only EOS.

    Args:
        token_texts: the text of every token id (``""`` for special tokens).
        prompt_length: tokens before the generated part in ``input_ids`` (left padding included),
            as ``generate()`` passes them.
        eos_token_id: the token that ends the generation after ``]``.
    """

    def __init__(self, token_texts: Sequence[str], prompt_length: int, eos_token_id: int):
        self.prompt_length = prompt_length
        self.eos = eos_token_id
        states = range(len(_MOVES))
        # next_state[s][t]: the state after token t from state s (-1: not allowed)
        self.next_state = [[_walk(s, t) if t else -1 for t in token_texts] for s in states]
        vocab = len(token_texts)
        self.allowed = torch.zeros(len(_MOVES), vocab, dtype=torch.bool)
        for s in states:
            self.allowed[s] = torch.tensor([n >= 0 for n in self.next_state[s]])
        self.allowed[DONE] = False
        self.allowed[DONE, eos_token_id] = True

    @classmethod
    def from_tokenizer(cls, tokenizer, prompt_length: int) -> JsonIntArrayProcessor:
        texts = [
            tokenizer.decode([i]) if i not in tokenizer.all_special_ids else "" for i in range(len(tokenizer))
        ]
        return cls(texts, prompt_length, tokenizer.eos_token_id)

    def state(self, generated: Sequence[int]) -> int:
        """The automaton state after ``generated`` (-1: outside the grammar)."""
        state = START
        for t in generated:
            state = self.next_state[state][t] if t < len(self.next_state[state]) else -1
            if state < 0:
                break
        return state

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = [self.state(r[self.prompt_length :]) for r in input_ids.tolist()]
        masks = self.allowed[[s if s >= 0 else DONE for s in rows]].to(scores.device)
        return scores.masked_fill(~masks[:, : scores.shape[-1]], float("-inf"))


def main() -> None:
    from specsplit import SpecSplitConfig, SpecSplitGenerator

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default=None, help="a draft model (default: none; n-gram trees)")
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "suffix", "hybrid", "auto", "model"])
    ap.add_argument("--prompt", default="Write the first 40 prime numbers as a JSON array of integers.")
    ap.add_argument("--max-new-tokens", type=int, default=220)
    ap.add_argument("--cuda-graphs", action="store_true", help="SpecSplit's CUDA-graph path (a GPU)")
    ap.add_argument("--warmup", action="store_true", help="one untimed run of each side first")
    ap.add_argument(
        "--dtype", default=None, help="weights' dtype (float32: token-exact against HF on any device)"
    )
    args = ap.parse_args()

    cfg = SpecSplitConfig(drafter=args.drafter)
    cfg.target.cuda_graphs = cfg.draft.cuda_graphs = args.cuda_graphs
    if args.dtype:
        cfg.target.dtype = cfg.draft.dtype = args.dtype
    gen = SpecSplitGenerator.from_pretrained(target=args.target, draft=args.draft, config=cfg)
    tok, model = gen.tokenizer, gen.target_engine.runner.model if gen.target_engine else None
    messages = [{"role": "user", "content": args.prompt}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    constrain = JsonIntArrayProcessor.from_tokenizer(tok, ids.shape[1])
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        repetition_penalty=1.0,
        logits_processor=[constrain],
    )

    if args.warmup:
        gen.generate(ids, **kw)
    t = time.perf_counter()
    out = gen.generate(ids, return_dict_in_generate=True, **kw)
    ours_s = time.perf_counter() - t
    answer = tok.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
    print(answer)
    body = [t for t in out.sequences[0, ids.shape[1] :].tolist() if t != constrain.eos]
    if constrain.state(body) == DONE:
        print("a complete JSON array of", len(json.loads(answer)), "integers")
    else:
        print("cut at max_new_tokens; a valid prefix so far:", constrain.state(body) >= 0)
    s = out.spec_stats.summary()
    print(f"SpecSplit ({args.drafter}): {s['new_tokens']} tokens in {ours_s:.2f} s, tau {s['tau']:.2f}")
    if model is not None:  # the same processor in HF generate(): the same tokens
        mask = torch.ones_like(ids).to(model.device)
        with torch.inference_mode():
            if args.warmup:
                model.generate(ids.to(model.device), attention_mask=mask, **kw)
            t = time.perf_counter()
            ref = model.generate(ids.to(model.device), attention_mask=mask, **kw)
            hf_s = time.perf_counter() - t
        same = torch.equal(ref.cpu(), out.sequences)
        print(f"HF generate(): {hf_s:.2f} s; identical output: {same}; speedup {hf_s / ours_s:.2f}x")
    gen.close()


if __name__ == "__main__":
    main()
